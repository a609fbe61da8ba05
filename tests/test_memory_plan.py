"""The memory plan that counts everything (node/engine/memory.py, model_sizes.py, `doctor --plan`):
sizes computed from a config equal what `pull` writes and what mlx-lm's cache holds, K3's plan
meets the issue's targets, and `--max-context` is enforced with a clear error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from repos import KIMI_K3

from expertmesh.cli import main
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.engine.core_quantization import quantize_core
from expertmesh.node.engine.model_sizes import ModelSizes, kimi_k3_config
from expertmesh.node.hub import local_models

GB, GiB = 10**9, 1024**3


@pytest.fixture(scope="module")
def home(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pulled_home("kimi_k3", tmp_path_factory.mktemp("plan"))


def test_a_core_computed_from_its_config_is_what_pull_writes(home: Path, tmp_path: Path) -> None:
    path = local_models.find_pulled(home, KIMI_K3)
    sizes = ModelSizes(json.loads((path / "config.json").read_text()))
    for bits, recipe in ((4, None), (4, "mixed_4_6"), (8, None)):
        copy = tmp_path / f"{bits}-{recipe}"
        shutil.copytree(path, copy)
        written = quantize_core(copy, bits, recipe).core_bytes_after
        assert sizes.layout(bits, recipe).core_bytes == written, (bits, recipe)


def test_the_context_computed_from_its_config_is_what_mlx_lms_cache_holds(home: Path, oracle) -> None:
    model, _ = oracle.load("kimi_k3")
    config = json.loads((local_models.find_pulled(home, KIMI_K3) / "config.json").read_text())
    for n in (300, 700):  # not the probe's own lengths: a KV cache holds them in 256-token steps
        cache = make_prompt_cache(model)
        model(mx.array([[1] * n]), cache=cache)
        held = sum(a.nbytes for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
        assert ModelSizes(config).context_bytes(n) == held


def test_k3s_core_by_its_shape_meets_the_targets() -> None:
    """Computed from K3's shape, not measured: the BF16 core is the ≈114.4 GB the project quotes,
    uniform 4-bit ≤ 33 GB, the default mixed recipe ≤ 40 GB."""
    sizes = ModelSizes(kimi_k3_config())
    assert abs(sizes.layout().core_bytes - 114.4 * GB) < 0.01 * 114.4 * GB
    assert sizes.layout(4).core_bytes <= 33 * GB
    assert sizes.layout(4, "mixed_4_6").core_bytes <= 40 * GB
    assert sizes.layout(4).core_bytes < sizes.layout(4, "mixed_4_6").core_bytes < sizes.layout(8).core_bytes


def test_doctor_plans_k3_on_a_64_gb_mac(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    argv = ["doctor", "--plan", "k3", "--memory", "64GB", "--max-context", "32768"]
    assert main([*argv, "--core-quant", "mixed_4_6", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["fits"] and doc["computed"] and doc["working_set_bytes"] == 48 * GiB
    assert doc["core_bytes"] <= 40 * GB and doc["ram_tier_bytes"] >= 4 * GB and doc["context_bytes"] > 0
    # a 32k-token prompt prefilled layer-major: 32k + one chunk of rows, each 3,584 wide into the
    # experts and 16 x 3,584 out of them, in BF16
    assert doc["prompt_bytes"] == (32768 + 2048) * (3584 + 16 * 3584) * 2
    parts = ("core_bytes", "context_bytes", "prefix_cache_bytes", "prompt_bytes", "ram_tier_bytes")
    assert sum(doc[p] for p in parts) <= doc["working_set_bytes"]
    line = capsys.readouterr().out
    assert "K3 on a 64 GB Mac (computed from its shape, not measured)" in line and "context 32k" in line
    assert "prompt's expert outputs 4.24 GB" in line
    # the BF16 core does not fit: streamed, and the changes that would hold it whole are said
    assert main([*argv, "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert not doc["fits"] and doc["streamed"] and doc["core_held_bytes"] < doc["core_bytes"]
    assert doc["core_read_bytes_per_token"] > 0
    assert any(c.startswith("--core-quant mixed_4_6") for c in doc["changes"]), doc["changes"]
    assert "to hold the core whole: " in capsys.readouterr().out


def test_a_pulled_repo_is_planned_from_its_files(home: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("EXPERTMESH_HOME", str(home))
    out = tmp_path / "plan.json"
    assert main(["doctor", "--plan", KIMI_K3, "--memory", "16GB", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    marker = local_models.read_marker(local_models.find_pulled(home, KIMI_K3))
    assert doc["fits"] and not doc["computed"] and doc["core_bytes"] == marker["core_bytes"]
    assert main(["doctor", "--plan", KIMI_K3, "--memory", "16GB", "--core-bits", "4", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["computed"] and json.loads(out.read_text())["core_bytes"] < marker["core_bytes"]
    assert main(["doctor", "--plan", "not/pulled"]) == 1
    assert "not pulled" in capsys.readouterr().err


def test_a_prompt_beyond_max_context_is_one_clear_line(home: Path, hub: HubServer, monkeypatch, capsys) -> None:
    monkeypatch.setenv("EXPERTMESH_HOME", str(home))
    argv = ["run", KIMI_K3, "one two three four five six", "--no-discovery", "--no-fill", "--max-tokens", "2"]
    assert main([*argv, "--max-context", "4"]) == 1
    err = capsys.readouterr().err
    assert "error:" in err and "--max-context" in err and "Traceback" not in err
    assert main([*argv, "--max-context", "64"]) == 0
    assert "context 64" in capsys.readouterr().err  # the plan counted 64 tokens of context


def test_run_prints_its_plan_and_what_a_streamed_core_read(home: Path, hub: HubServer, monkeypatch, capsys) -> None:
    monkeypatch.setenv("EXPERTMESH_HOME", str(home))
    argv = [
        "run",
        KIMI_K3,
        "stream the core",
        "--no-discovery",
        "--no-fill",
        "--max-tokens",
        "3",
        "--core-budget",
        "25%",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "memory on this machine: core bf16" in err and "streamed from the SSD within" in err
    assert "within --core-budget" in err and "core streamed from the SSD:" in err and "a token" in err
