"""Repos as Mac users download them — made by mlx-lm's own `convert -q`, what mlx-community
publishes — pull and stream token for token as mlx-lm runs the same folder.

Two tiny registry repos are converted with every entry of `QUANTS` (2, 3, 4, 6 and 8 bits,
affine groups of 64 and 32, every mixed recipe, mxfp4, nvfp4, mxfp8):

- glm4_moe at the registry's widths: its experts are 32 wide, so mlx-lm's default affine groups
  of 64 leave each down projection unquantised (a predicate's exception), while the mixed
  recipes' per-layer entries carry `group_size: null` (the mode's default);
- qwen3_moe with experts 64 wide: every projection quantised, the mixed recipes' 6-bit layers too.

The reading they test (node/model/mlx_quantization.py) is also checked against mlx-lm's own
`nn.quantize` entry by entry, and what cannot stream is refused at `pull`, in one line, before
any core byte is fetched. benchmarks/bench_conversions.py runs the same matrix over every
architecture of the registry. The module takes about 20 s on two CPU cores (MLX 0.32.4).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.utils import quantize_model, save

from expertmesh.cli import main
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny.conversions import QUANTS, build_upstream, compare, convert
from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.hub import client as hub_client
from expertmesh.node.model.mlx_quantization import StoredPacking, projection_quantization

ARCHS = {"glm4_moe": {}, "qwen3_moe": {"moe_intermediate_size": 64}}  # arch -> widths replaced


@pytest.fixture(scope="module")
def conversions(tmp_path_factory: pytest.TempPathFactory):
    """A local Hub serving `conv/<arch>-<quant>` for every arch and quant, and the folder of each."""
    root = tmp_path_factory.mktemp("conversions")
    folders = {}
    for arch, sizes in ARCHS.items():
        upstream = root / "upstream" / arch
        upstream.mkdir(parents=True)
        build_upstream(upstream, arch, **sizes)
        for quant in QUANTS:
            folders[arch, quant] = convert(upstream, root / "hub" / "conv" / f"{arch}-{quant}", quant)
    with HubServer(root / "hub") as server, hub_client.using_endpoint(server.url):
        yield folders


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_convert_q_output_streams_as_mlx_lm_runs_it(arch: str, quant: str, conversions, tmp_path: Path) -> None:
    folder = conversions[arch, quant]
    result = compare(f"conv/{arch}-{quant}", folder, tmp_path)
    assert result.mlx_lm, f"{arch} {quant}: mlx-lm generated nothing to compare with"
    assert result.streamed == result.mlx_lm, f"{arch} {quant}: streamed {result.streamed}, mlx-lm {result.mlx_lm}"
    assert result.from_hub > 0, f"{arch} {quant}: no expert came from the Hub"
    quantization = json.loads((folder / "config.json").read_text())["quantization"]
    affine_64 = quantization["mode"] == "affine" and quantization["group_size"] == 64
    # what the cases are for: an unquantised projection exactly where mlx-lm's group does not divide
    assert result.dense == (("down_proj",) if arch == "glm4_moe" and affine_64 else ()), result.dense


# -- the reading, entry by entry, against mlx-lm's own nn.quantize ------------------------------

PATH = "layers.0.mlp.switch_mlp.gate_proj"
TOP = {"group_size": 32, "bits": 8, "mode": "affine"}  # top-level defaults unlike any entry's


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = SwitchLinear(128, 16, 2, bias=False)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Module()]
        self.layers[0].mlp = nn.Module()
        self.layers[0].mlp.switch_mlp = _Block()


def _built(entry) -> tuple[nn.Module, StoredPacking]:
    """What mlx-lm's loader builds for `PATH` given `entry` (its class_predicate returns the entry
    of a path the config names), and that module's parameters as a conversion stores them."""
    model = _Model()
    asked = dict(entry) if isinstance(entry, dict) else entry  # nn.quantize pops keys of what it is given
    nn.quantize(
        model, TOP["group_size"], TOP["bits"], mode=TOP["mode"], class_predicate=lambda p, m: p == PATH and asked
    )
    layer = model.layers[0].mlp.switch_mlp.gate_proj
    stored = StoredPacking(
        128, tuple(layer.weight.shape), tuple(layer.scales.shape), layer.scales.dtype, layer.get("biases") is not None
    )
    return layer, stored


@pytest.mark.parametrize(
    "entry",
    [
        {"group_size": None, "bits": 4, "mode": "affine"},  # what mixed recipes write
        {"group_size": None, "bits": 6, "mode": "affine"},
        {"bits": 3},  # keys left out: SwitchLinear.to_quantized's defaults
        {"group_size": 128, "bits": 2, "mode": "affine", "quantize_input": False},  # nn.quantize drops it
        {"group_size": None, "bits": None, "mode": "mxfp4"},
        {"group_size": None, "bits": None, "mode": "nvfp4"},
        {"group_size": None, "bits": None, "mode": "mxfp8"},
        True,  # nn.quantize's own defaults, the config's top level
    ],
    ids=str,
)
def test_an_entry_reads_as_mlx_lm_builds_it_and_runs_the_same_kernel(entry) -> None:
    layer, stored = _built(entry)
    spec = projection_quantization({**TOP, PATH: entry}, PATH, stored, "layer 0 gate_proj")
    assert spec is not None and spec.mode == layer.mode
    x = mx.random.normal((1, 1, 128), key=mx.random.key(0))
    indices = mx.array([[1]])
    got = mx.gather_qmm(
        x,
        layer.weight,
        layer.scales,
        layer.get("biases"),
        rhs_indices=indices,
        transpose=True,
        group_size=spec.group_size,
        bits=spec.bits,
        mode=spec.mode,
    )
    assert mx.array_equal(got, layer(x, indices)).item(), f"{entry}: {spec} computes otherwise than mlx-lm's layer"


def test_a_path_without_an_entry_is_read_from_its_tensors_not_the_top_level() -> None:
    """mlx-lm infers an unnamed path's packing (infer_quant_config): the top level can be wrong."""
    _, stored = _built({"group_size": 64, "bits": 4, "mode": "affine"})
    spec = projection_quantization(TOP, PATH, stored, "layer 0 gate_proj")
    assert spec is not None and (spec.mode, spec.bits, spec.group_size) == ("affine", 4, 64)
    assert projection_quantization(TOP, PATH, StoredPacking(128, (2, 16, 128), None, None, False), "x") is None


@pytest.mark.parametrize(
    "entry, stored_as, says",
    [
        ({"group_size": None, "bits": 8, "mode": "affine"}, {"bits": 4}, "stored packing (4 bits, groups of 64)"),
        (False, {"bits": 4}, "leaves it unquantised"),
        ({"group_size": None, "bits": None, "mode": "mxfp4"}, {"bits": 4, "group_size": 32}, "not mxfp4"),
        ({"group_size": 32, "bits": 3, "mode": "mxfp4"}, {"bits": 4}, "mxfp4 quantization requires bits to be 4"),
        ({"bits": 4, "mode": "nvfp4", "global_scale": True}, {"bits": 4}, "global scale"),
    ],
)
def test_a_packing_mlx_lm_would_not_build_is_refused_saying_why(entry, stored_as: dict, says: str) -> None:
    _, stored = _built({"mode": "affine", **stored_as})
    with pytest.raises(UnsupportedModelError, match="^layer 0 gate_proj: ") as e:
        projection_quantization({**TOP, PATH: entry}, PATH, stored, "layer 0 gate_proj")
    assert says in str(e.value) and "\n" not in str(e.value)


# -- refused at pull --------------------------------------------------------------------------


def _pull_cli(repo_id: str, home: Path, monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setenv("EXPERTMESH_HOME", str(home))
    code = main(["pull", repo_id, "--no-progress"])
    return code, capsys.readouterr().err


def test_a_conversion_that_cannot_stream_is_refused_at_pull_in_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """A hand-edited config that asks 8 bits of experts stored at 4 (mlx-lm would not load it),
    and an nvfp4 with a global scale per expert (`quantize_model(global_scale=True)`, which the
    streamed kernels cannot take): `pull` says what and why in one line, before any core byte."""
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    build_upstream(upstream, "qwen3_moe", moe_intermediate_size=64)
    hub = tmp_path / "hub" / "conv"
    edited = convert(upstream, hub / "edited", "4bit")
    config = json.loads((edited / "config.json").read_text())
    config["quantization"]["model.layers.1.mlp.switch_mlp.up_proj"] = {"group_size": 64, "bits": 8, "mode": "affine"}
    (edited / "config.json").write_text(json.dumps(config))
    from mlx_lm import load

    model, tokenizer, config = load(str(upstream), return_config=True)
    model, config = quantize_model(model, config, None, None, mode="nvfp4", global_scale=True)
    save(hub / "global_scale", str(upstream), model, tokenizer, config)
    with HubServer(tmp_path / "hub") as server, hub_client.using_endpoint(server.url):
        for name, says in (
            ("edited", "layer 1 up_proj: stored packing (4 bits"),
            ("global_scale", "layer 0 gate_proj: quantised with a global scale per expert (nvfp4)"),
        ):
            home = tmp_path / f"home-{name}"
            code, err = _pull_cli(f"conv/{name}", home, monkeypatch, capsys)
            assert code != 0 and err.startswith("error: conv/") and err.count("\n") == 1, err
            assert says in err, err
            assert not list(home.rglob("*.safetensors")), "the core was fetched before the refusal"
    shutil.rmtree(tmp_path / "hub")
