"""The expert index learns experts from mlx-lm's sanitize, traced (node/model/expert_trace.py).

Each expert, decoded from its byte ranges alone, must equal mlx-lm's own parameter slice bit for
bit, in every encoding: per-expert BF16, FP8 with block scales, compressed-tensors mxfp4 and int4,
gpt-oss's interleaved mxfp4 blocks, fused gate/up stacked (and transposed), MLX 4-bit; tensor
order in a file never matters; and a model expertmesh cannot stream says what is missing.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from expertmesh.devtools.tiny import registry
from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.model import mlx_lm_models, safetensors_format
from expertmesh.node.model.codec import ExpertCodec
from expertmesh.node.model.expert_index import ExpertIndex, build_index


def _headers(repo: Path) -> dict:
    return {p.name: (safetensors_format.read_header(p), p.stat().st_size) for p in sorted(repo.glob("*.safetensors"))}


def _index(repo: Path) -> ExpertIndex:
    return build_index("t/x", "0" * 40, _headers(repo), json.loads((repo / "config.json").read_text()))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory):
    """`made(module)`: a tiny registry repo of mlx-lm's `module`, made once per test module."""
    root = tmp_path_factory.mktemp("trace")
    repos: dict[str, Path] = {}

    def get(module: str) -> Path:
        if module not in repos:
            out = root / module
            out.mkdir()
            registry.build(out, module)
            repos[module] = out
        return repos[module]

    return get


def _assert_experts_equal_mlx_lm(repo: Path, index: ExpertIndex) -> None:
    """Every expert decoded from its ranges equals mlx-lm's loaded parameters, bit for bit."""
    model, config = load_model(repo)
    params = dict(tree_flatten(model.parameters()))
    paths = {}
    for path, kind in mlx_lm_models.expert_blocks(model).items():
        module = dict(model.named_modules())[path]
        paths[mlx_lm_models.layer_number(path)] = (path, module, mlx_lm_models.BLOCK_PROJECTIONS[kind])
    codec = ExpertCodec(
        config.get("quantization"),
        {layer: path for layer, (path, _, _) in paths.items()},
        {layer: {p: getattr(m, p).input_dims for p in projs} for layer, (_, m, projs) in paths.items()},
    )
    raw = {p.name: p.read_bytes() for p in repo.glob("*.safetensors")}
    assert index.experts
    for (layer, e), loc in index.experts.items():
        weights = codec.decode(loc, b"".join(raw[r.file][r.start : r.end] for r in loc.ranges))
        path, _, projs = paths[layer]
        assert sorted(weights.projections) == sorted(projs)
        for proj in projs:
            got = weights.projections[proj]
            for kind in ("weight", "scales", "biases", "bias"):
                want = params.get(f"{path}.{proj}.{kind}")
                have = getattr(got, kind)
                assert (want is None) == (have is None), (layer, e, proj, kind)
                if want is not None:
                    assert have.dtype == want.dtype and mx.array_equal(have, want[e], equal_nan=True).item(), (
                        layer,
                        e,
                        proj,
                        kind,
                    )


@pytest.mark.parametrize("arch", ["kimi_k3", "deepseek_v3", "qwen3_moe", "mlx_qwen3_moe"])
def test_fixture_experts_decode_to_mlx_lms_parameters(arch: str, tiny_repos: dict[str, Path]) -> None:
    index = _index(tiny_repos[arch])
    _assert_experts_equal_mlx_lm(tiny_repos[arch], index)
    if arch in ("kimi_k3", "deepseek_v3"):  # per-expert checkpoints: one request per expert, as before
        assert all(len(loc.ranges) == 1 for loc in index.experts.values())


@pytest.mark.parametrize(
    "module",
    [
        "deepseek_v3",
        "gpt_oss",
        "llama4",
        "qwen3_5_moe",
        "granitemoe",
        "step3p5",
        "mixtral",
        "gemma4_text",
        "nemotron_h",  # SwitchMLP: fc1/fc2, no gate
        "phixtral",  # SwitchMLP with biases, in transformer.h.{l}
    ],
)
def test_every_layout_decodes_to_mlx_lms_parameters(module: str, made) -> None:
    repo = made(module)
    index = _index(repo)
    _assert_experts_equal_mlx_lm(repo, index)
    path = tmp = repo.parent / f"{module}-index.json"
    index.save(tmp)
    assert ExpertIndex.load(path).experts == index.experts


def test_a_fused_gate_up_expert_is_one_row_slice_of_each_stacked_tensor(made) -> None:
    repo = made("qwen3_5_moe")  # experts.gate_up_proj (E, 2·I, H) + experts.down_proj (E, H, I)
    index = _index(repo)
    headers = {n: e for tensors, _ in _headers(repo).values() for n, e in tensors.items()}
    loc = index.expert(1, 5)
    assert sorted(t.name.rsplit(".", 1)[-1] for t in loc.tensors) == ["down_proj", "gate_up_proj"]
    for t in loc.tensors:
        stacked = headers[t.name]
        row = stacked.nbytes // stacked.shape[0]
        assert t.stacked and (t.start, t.end) == (stacked.start + 5 * row, stacked.start + 6 * row)
        assert t.shape == stacked.shape[1:]
    assert '"index"' in loc.recipe.text  # gate and up: the two halves of the rows, split by the recipe


def test_tensor_order_in_a_file_never_matters(made, tmp_path: Path) -> None:
    """`mx.save_safetensors` writes tensors in hash order; mlx-lm reads such a file, so must we."""
    repo = tmp_path / "hash-ordered"
    shutil.copytree(made("qwen3_moe"), repo)
    weights = {}
    for shard in repo.glob("model-*.safetensors"):
        weights.update(mx.load(str(shard)))
        shard.unlink()
    (repo / "model.safetensors.index.json").unlink()
    mx.save_safetensors(str(repo / "model.safetensors"), weights)
    order = [
        e.name
        for e in sorted(safetensors_format.read_header(repo / "model.safetensors").values(), key=lambda e: e.start)
    ]
    assert order != sorted(order)  # really not in name order
    index = _index(repo)
    assert len({loc.recipe.text for loc in index.experts.values()}) == 1
    _assert_experts_equal_mlx_lm(repo, index)


def test_an_index_of_format_1_still_decodes_by_name(tiny_repos: dict[str, Path], tmp_path: Path) -> None:
    """A home pulled before recipes keeps working: its experts are recognised by name, as then."""
    repo = tiny_repos["kimi_k3"]
    index = _index(repo)
    index.save(tmp_path / "v2.json")
    doc = json.loads((tmp_path / "v2.json").read_text())
    doc.update(format_version=1, experts=[row[:3] for row in doc["experts"]])
    del doc["recipes"], doc["recipe_texts"]
    (tmp_path / "v1.json").write_text(json.dumps(doc))
    old = ExpertIndex.load(tmp_path / "v1.json")
    assert all(loc.recipe is None for loc in old.experts.values())
    _assert_experts_equal_mlx_lm(repo, old)


# -- what pull says about a model it cannot stream -------------------------------------------------


def _entries(tensors: list[tuple[str, str, tuple[int, ...]]]) -> dict:
    out, at = {}, 0
    for name, dtype, shape in tensors:
        n = safetensors_format.tensor_nbytes(dtype, shape)
        out[name] = safetensors_format.TensorEntry(name, dtype, shape, at, at + n)
        at += n
    return {"model.safetensors": (out, at)}


def test_experts_in_a_layout_sanitize_does_not_map_are_named_not_called_dense(made) -> None:
    repo = made("qwen3_moe")
    config = json.loads((repo / "config.json").read_text())
    tensors = []
    for entry in (e for tensors_, _ in _headers(repo).values() for e in tensors_.values()):
        name = entry.name
        for proj, w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):  # not qwen3_moe's names
            name = re.sub(rf"experts\.(\d+)\.{proj}", rf"experts.\1.{w}", entry.name)
            if name != entry.name:
                break
        tensors.append((name, entry.dtype, entry.shape))
    with pytest.raises(UnsupportedModelError) as e:
        build_index("t/x", "0" * 40, _entries(tensors), config)
    message = str(e.value)
    assert "cannot yet address experts stored as" in message and "'qwen3_moe'" in message
    assert "w1.weight" in message and "no routed experts" not in message


def test_a_dense_model_is_called_dense() -> None:
    tensors = [("model.layers.0.mlp.up_proj.weight", "BF16", (4, 4))]
    with pytest.raises(UnsupportedModelError, match="no routed experts"):
        build_index("t/dense", "0" * 40, _entries(tensors), {"model_type": "llama"})


def test_a_blocks_own_parameters_beside_its_projections_are_core(made) -> None:
    """muse_spark keeps a norm under its experts (`experts.post_expert_norm`): one tensor for the
    layer, not per expert, so it is core and only the projections stream."""
    repo = made("muse_spark")
    index = _index(repo)
    assert any(n.endswith("experts.post_expert_norm.weight") for n in index.core)
    assert not any("post_expert_norm" in t.name for loc in index.experts.values() for t in loc.tensors)
    _assert_experts_equal_mlx_lm(repo, index)


def test_a_core_sanitize_makes_differently_without_experts_is_marked_for_stand_ins(made) -> None:
    """qwen3_next shifts its norms only when sanitize sees expert tensors: its index says the core
    must be sanitized with stand-ins of them, and names every expert tensor whole for that; a model
    whose sanitize ignores the experts' absence is not marked."""
    index = _index(made("qwen3_next"))
    assert index.sanitize_with_experts
    standins = index.expert_tensors()
    assert len(standins) == 3 * len(index.experts)  # per-expert gate/up/down, whole
    assert all(name not in index.core for name in standins)
    assert not _index(made("qwen3_moe")).sanitize_with_experts
