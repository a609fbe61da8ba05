"""`expertmesh pull --core-bits 8|4` and `--core-quant RECIPE`: which tensors are quantised to
which bits, that `run` uses them, bad values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.cli import main
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.engine.blocks import load_core_model
from expertmesh.node.engine.core_quantization import group_size_for, pull_with_core_bits
from expertmesh.node.hub import local_models


def _core_tensors(path: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in path.glob("model*.safetensors"):
        out.update(mx.load(str(f)))
    return out


@pytest.fixture(scope="module")
def homes(hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> dict[int | str, Path]:
    """A BF16 pull, an 8-bit, a 4-bit and a mixed_4_6 pull of the tiny K3."""
    out: dict[int | str, Path] = {}
    for bits in (16, 8, 4, "mixed_4_6"):
        out[bits] = tmp_path_factory.mktemp(f"core{bits}")
        fmt = {"core_quant": bits} if isinstance(bits, str) else {"core_bits": bits}
        pull_with_core_bits(KIMI_K3, home=out[bits], progress=False, **fmt)
    return out


def _layer_bits(path: Path) -> dict[str, tuple[int, int]]:
    """Quantised layer -> (bits, group size), as mlx-lm's loader reads them from the shapes."""
    model, _, _ = load_core_model(path, lazy=True)
    return {
        k: (m.bits, m.group_size) for k, m in model.named_modules() if hasattr(m, "bits") and hasattr(m, "group_size")
    }


def test_core_bits_4_quantises_every_layer_to_4_bits_in_groups_of_64(homes) -> None:
    layers = _layer_bits(local_models.find_pulled(homes[4], KIMI_K3))
    routers = {k: layers.pop(k) for k in list(layers) if k.endswith("mlp.gate")}
    assert routers and set(routers.values()) == {(8, 64)}  # what K3's quant_predicate asks mlx-lm to give them
    assert layers and {b for b, _ in layers.values()} == {4} and {g for _, g in layers.values()} == {64}
    # 32 wide: no group of 64 fits, and 4 bits in groups of 32 would add both errors: BF16, as mlx-lm leaves them
    assert not any(k.endswith(("routed_expert_up_proj", "unembed_out")) for k in layers)
    assert not any(k.endswith("res_proj") for k in layers)  # K3's predicate keeps them: read as vectors
    assert "language_model.lm_head" in layers and "language_model.model.embed_tokens" in layers


def test_the_mixed_recipe_gives_the_head_and_some_down_projections_6_bits(homes) -> None:
    """mlx-lm's mixed_4_6: lm_head at 6 bits, and in the layers its rule picks (the first and last
    eighth, every third between: 2 and 5 of 6) the projections whose names it matches (`down_proj`,
    `v_proj`, `v_a_proj`: K3's fused `qkv_proj` and `kv_a_proj_with_mqa` by substring, as in
    mlx-lm); everything else at 4."""
    layers = _layer_bits(local_models.find_pulled(homes["mixed_4_6"], KIMI_K3))
    assert layers["language_model.lm_head"] == (6, 64)
    layers = {k: v for k, v in layers.items() if not k.endswith("mlp.gate")}  # 8-bit routers, as for 4 bits
    six = {k for k, (b, _) in layers.items() if b == 6} - {"language_model.lm_head"}
    assert six and all(("layers.2." in k or "layers.5." in k) for k in six), six
    assert all(any(n in k for n in ("down_proj", "v_proj", "v_a_proj")) for k in six), six
    assert any("down_proj" in k for k in six)
    assert {b for k, (b, _) in layers.items() if k not in six and k != "language_model.lm_head"} == {4}
    marker = json.loads(
        (local_models.find_pulled(homes["mixed_4_6"], KIMI_K3) / local_models.COMPLETE_MARKER).read_text()
    )
    assert (marker["core_bits"], marker["core_quant"]) == (4, "mixed_4_6")
    four = json.loads((local_models.find_pulled(homes[4], KIMI_K3) / local_models.COMPLETE_MARKER).read_text())
    assert (
        four["core_bytes"]
        < marker["core_bytes"]
        < 0.45
        * json.loads((local_models.find_pulled(homes[16], KIMI_K3) / local_models.COMPLETE_MARKER).read_text())[
            "core_bytes"
        ]
    )


def test_core_bits_8_quantises_the_right_tensors_only(homes: dict[int, Path]) -> None:
    p16 = local_models.find_pulled(homes[16], KIMI_K3)
    p8 = local_models.find_pulled(homes[8], KIMI_K3)
    t8 = _core_tensors(p8)
    quantised = {k[: -len(".scales")] for k in t8 if k.endswith(".scales")}
    assert quantised, "no quantised layer in the 8-bit core"
    groups = {}
    for layer in quantised:
        assert t8[f"{layer}.weight"].dtype == mx.uint32 and f"{layer}.biases" in t8
        width = t8[f"{layer}.weight"].shape[-1] * 4  # 8-bit: 4 values per uint32
        g = groups[layer] = width // t8[f"{layer}.scales"].shape[-1]
        assert g == group_size_for(width), f"{layer}: groups of {g} for an input width of {width}"
        assert not layer.endswith(("mlp.gate", "router", "res_proj")) and "norm" not in layer.split(".")[-1], layer
    names = {k.rsplit(".", 1)[-1] for k in quantised}
    assert {"q_proj", "o_proj", "embed_tokens", "lm_head"} <= names, names  # the big matrices are quantised
    # the widest group that fits: 128 for the 128-wide down_proj, 32 for the 32-wide latent up-projection
    assert {g for k, g in groups.items() if k.endswith("shared_experts.down_proj")} == {128}
    assert {g for k, g in groups.items() if k.endswith(("routed_expert_up_proj", "unembed_out"))} == {32}
    assert {"routed_expert_up_proj", "unembed_out"} <= names, names
    kept = [
        k
        for k in t8
        if k.endswith(("mlp.gate.weight", "norm.weight", "res_proj.weight", ".bias", "embed_q.weight"))
        or "e_score_correction_bias" in k
    ]
    assert any(k.endswith("embed_q.weight") for k in kept)  # 16 wide: no group size divides it
    assert any(k.endswith("mlp.gate.weight") for k in kept) and any(k.endswith("norm.weight") for k in kept)
    for k in kept:
        assert mx.issubdtype(t8[k].dtype, mx.floating), f"{k} is {t8[k].dtype}: should stay full precision"
    assert not any(".experts." in k or "switch_mlp" in k for k in t8), "routed experts must not be in the core"
    m16 = json.loads((p16 / local_models.COMPLETE_MARKER).read_text())
    m8 = json.loads((p8 / local_models.COMPLETE_MARKER).read_text())
    assert (m16["core_bits"], m8["core_bits"]) == (16, 8)
    assert m8["core_bytes"] < 0.7 * m16["core_bytes"]


@pytest.mark.e2e
def test_run_uses_the_8_bit_core(homes: dict[int, Path], hub: HubServer) -> None:
    sm = open_model(KIMI_K3, home=homes[8])
    try:
        assert sm.core_bits == 8
        q = [m for _, m in sm.model.named_modules() if type(m).__name__ in ("QuantizedLinear", "QuantizedMultiLinear")]
        assert {type(m).__name__ for m in q} == {"QuantizedLinear", "QuantizedMultiLinear"}
        assert all(m.bits == 8 and m.mode == "affine" for m in q)
        assert all(m.group_size == group_size_for(m.weight.shape[-1] * 32 // m.bits) for m in q)
        assert {m.group_size for m in q} == {32, 64, 128}
    finally:
        sm.close()
    env = {**os.environ, "EXPERTMESH_HOME": str(homes[8]), "HF_ENDPOINT": hub.url}
    r = subprocess.run(
        [sys.executable, "-m", "expertmesh", "run", KIMI_K3, "hello experts", "--max-tokens", "6"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "6 tokens in" in r.stderr and r.stdout.strip()


def test_pulling_8_bits_over_a_bf16_pull_quantises_in_place(
    pulled_home, hub: HubServer, tmp_path: Path, capsys, monkeypatch
) -> None:
    pulled_home("kimi_k3", tmp_path)
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path))
    assert main(["pull", KIMI_K3, "--core-bits", "8", "--no-progress"]) == 0
    assert "8-bit weights" in capsys.readouterr().out
    path = local_models.find_pulled(tmp_path, KIMI_K3)
    assert any(k.endswith(".scales") for k in _core_tensors(path))
    assert main(["pull", KIMI_K3, "--core-bits", "16", "--no-progress"]) != 0  # the BF16 core is gone
    err = capsys.readouterr().err
    assert err.startswith("error:") and "pull again" in err and "Traceback" not in err


def test_a_bad_core_bits_value_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["pull", KIMI_K3, "--core-bits", "5"])
    assert e.value.code == 2 and "--core-bits" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--core-quant", "mixed_5_7"], "--core-quant must be one of mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6"),
        (["--core-quant", "mixed_4_6", "--core-bits", "8"], "quantises to 4 bits"),
    ],
)
def test_a_bad_recipe_is_one_line_before_anything_is_fetched(
    argv, words, hub: HubServer, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path))
    assert main(["pull", KIMI_K3, "--no-progress", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error:") and words in err and "Traceback" not in err
    assert hub.stats().get("requests", 0) == 0 or not (tmp_path / "models").exists()
