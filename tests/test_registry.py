"""Every Mixture-of-Experts architecture of the installed mlx-lm, streamed against mlx-lm itself.

For each mlx-lm model module that builds a `SwitchGLU` or `SwitchMLP` (read from mlx-lm's source,
node/model/mlx_lm_models.py), a tiny repo in an upstream layout is made
(expertmesh/devtools/tiny/registry.py), pulled through a local Hub and streamed: its greedy tokens must
equal `mlx_lm.stream_generate` on the whole repo. An architecture that cannot be streamed yet is
skipped with the precise reason — what `pull` says, or why no tiny repo exists — so
`pytest -rs tests/test_registry.py` prints them. The last test checks that README.md lists exactly
the architectures that stream; `EXPERTMESH_UPDATE_README=1` rewrites that list instead.

Each architecture that streams is also quantised to a 4-bit core (`pull --core-bits 4`) and
compared with mlx-lm running that same core with its own upstream experts.

Budget: tiny repos (2 layers of 8 experts, hidden 64), one per architecture, made once per module;
the whole module runs in about 25 s on two CPU cores (measured with MLX 0.32.4 on the CPU).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import infer_quant_config

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import registry
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine import generation
from expertmesh.node.engine.core_quantization import pull_with_core_bits, quantize_core
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub import local_models
from expertmesh.node.hub.pull import pull
from expertmesh.node.model.mlx_lm_models import expert_modules

ARCHS = list(expert_modules())
PROMPT = "hello experts"
MAX_TOKENS = 8
LONG_PROMPT = "the quick brown fox jumps over the lazy dog while experts stream from the hub layer by layer"
CHUNK = 5  # prefill chunk of the long prompt: several chunks and the last token
README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- supported-architectures:begin -->", "<!-- supported-architectures:end -->"

STREAMED: dict[str, str] = {}  # module -> its layout's description, as the tests find them
NOT_YET: dict[str, str] = {}  # module -> why not


@pytest.fixture(scope="module")
def registry_hub(tmp_path_factory: pytest.TempPathFactory):
    """A local Hub serving one tiny repo per architecture (`registry/<module>`), and the
    architectures no repo could be made for, with why."""
    root = tmp_path_factory.mktemp("registry-hub")
    made: dict[str, registry.Made] = {}
    failed: dict[str, str] = {}
    for arch in ARCHS:
        out = root / "registry" / arch
        out.mkdir(parents=True)
        try:
            made[arch] = registry.build(out, arch)
        except ValueError as e:
            shutil.rmtree(out)
            failed[arch] = str(e)
    with HubServer(root) as server, hub_client.using_endpoint(server.url):
        yield root / "registry", made, failed


def _mlx_lm_tokens(model, tokenizer, ids: list[int], prefill_step_size: int = generation.PREFILL_STEP) -> list[int]:
    out = []
    steps = mlx_lm.stream_generate(
        model,
        tokenizer,
        mx.array(ids),
        max_tokens=MAX_TOKENS,
        sampler=make_sampler(0.0),
        prefill_step_size=prefill_step_size,
    )
    for r in steps:
        if r.finish_reason == "stop":
            break
        out.append(r.token)
    return out


def _not_yet(arch: str, reason: str) -> None:
    NOT_YET[arch] = reason
    pytest.skip(f"{arch}: {reason}")


@pytest.mark.parametrize("arch", ARCHS)
def test_streams_equal_to_mlx_lm(arch: str, registry_hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repos, made, failed = registry_hub
    if arch in failed:
        _not_yet(arch, f"no tiny repo: {failed[arch]}")
    try:
        pull(f"registry/{arch}", home=tmp_path, progress=False)
    except UnsupportedModelError as e:
        _not_yet(arch, str(e))
    sm = open_model(f"registry/{arch}", home=tmp_path, store=StoreConfig(ram_budget="50%", prefetch=True, fill=False))
    try:
        ref, tokenizer = mlx_lm.load(str(repos / arch))
        if sm.codec.dense_dtype is not None:  # dense experts on a CPU run in float32: so must the oracle
            ref.set_dtype(sm.codec.dense_dtype)
        ids = tokenizer.encode(PROMPT)
        try:
            expected = _mlx_lm_tokens(ref, tokenizer, ids)
        except RuntimeError as e:  # mlx-lm's own kernels for it (mlx_lm/kernels) exist only on Metal
            if "Metal" not in str(e) or mx.metal.is_available():
                raise
            _not_yet(arch, f"pulls, but mlx-lm itself runs {arch} only on Metal ({e}): untested on this machine")
        summary = GenerationSummary()
        settings = SamplingSettings(max_tokens=MAX_TOKENS, temp=0.0)
        got = [t.id for t in Generator(sm).generate(ids, settings, lambda: False, summary)]
        # a prompt of several prefill chunks, prefilled layer-major (node/engine/prefill.py), against
        # mlx-lm fed in the same chunks: the caches must see mlx-lm's updates, masks and offsets
        long_ids = tokenizer.encode(LONG_PROMPT)
        chunked = _mlx_lm_tokens(ref, tokenizer, long_ids, prefill_step_size=CHUNK)
        monkeypatch.setattr(generation, "PREFILL_STEP", CHUNK)
        got_chunked = [t.id for t in Generator(sm).generate(long_ids, settings, lambda: False)]
    finally:
        sm.close()
    assert expected, f"{arch}: mlx-lm generated nothing to compare with"
    assert got == expected, f"{arch} ({made[arch].layout.name}): streamed {got}, mlx-lm {expected}"
    assert got_chunked == chunked, f"{arch}, prompt in chunks of {CHUNK}: streamed {got_chunked}, mlx-lm {chunked}"
    assert summary.experts.uses["hub"] > 0, f"{arch}: no expert came from the Hub: nothing was streamed"
    STREAMED[arch] = made[arch].layout.description
    _quantised_core_streams_equal_to_mlx_lm(arch, repos / arch, tmp_path, ids)


def _quantised_core_streams_equal_to_mlx_lm(arch: str, repo: Path, home: Path, ids: list[int]) -> None:
    """The same pull quantised to a 4-bit core (`pull --core-bits 4`, in place, its experts now on
    disk) against mlx-lm's `load` of the upstream repo — its experts as published — with that very
    core put in as mlx-lm's loader puts a quantised one (`infer_quant_config`)."""
    path = local_models.find_pulled(home, f"registry/{arch}")
    quantize_core(path, 4)
    sm = open_model(f"registry/{arch}", home=home, store=StoreConfig(ram_budget="50%", prefetch=False, fill=False))
    try:
        ref, tokenizer = mlx_lm.load(str(repo))
        core = {}
        for f in sorted(path.glob("model*.safetensors")):
            core.update(mx.load(str(f)))
        nn.quantize(ref, class_predicate=lambda p, m: f"{p}.scales" in core and infer_quant_config(p, m, core))
        assert set(core) <= {k for k, _ in tree_flatten(ref.parameters())}, f"{arch}: the core's names are not mlx-lm's"
        ref.load_weights(list(core.items()), strict=False)
        if sm.codec.dense_dtype is not None:
            ref.set_dtype(sm.codec.dense_dtype)
        expected = _mlx_lm_tokens(ref, tokenizer, ids)
        settings = SamplingSettings(max_tokens=MAX_TOKENS, temp=0.0)
        got = [t.id for t in Generator(sm).generate(ids, settings, lambda: False, GenerationSummary())]
    finally:
        sm.close()
    assert sm.core_bits == 4
    assert got == expected, f"{arch} with a 4-bit core: streamed {got}, mlx-lm {expected}"


def test_a_core_sanitize_treats_differently_without_experts_loads_as_mlx_lm_makes_it(registry_hub, tmp_path) -> None:
    """qwen3_next's sanitize shifts its norms only when it sees expert tensors: the pulled core is
    loaded with stand-ins of them (ExpertIndex.sanitize_with_experts), in BF16 and when quantised to
    8 bits, whose saved core is already sanitized and must not be shifted a second time."""
    repos, made, failed = registry_hub
    if "qwen3_next" in failed or "qwen3_next" not in ARCHS:
        pytest.skip(f"no tiny qwen3_next repo with this mlx-lm: {failed.get('qwen3_next', 'not in the registry')}")
    from mlx.utils import tree_flatten

    ref, _ = mlx_lm.load(str(repos / "qwen3_next"))
    want = {
        k: v for k, v in tree_flatten(ref.parameters()) if k.endswith("layernorm.weight") or k == "model.norm.weight"
    }
    assert want, "the tiny qwen3_next has no norms to compare"
    for bits in (16, 8):
        home = tmp_path / f"core{bits}"
        pull_with_core_bits("registry/qwen3_next", home=home, progress=False, core_bits=bits)
        sm = open_model("registry/qwen3_next", home=home, store=StoreConfig(ram_budget="50%", fill=False))
        try:
            assert sm.index.sanitize_with_experts
            got = dict(tree_flatten(sm.model.parameters()))
            for k, v in want.items():
                assert mx.array_equal(got[k], v.astype(got[k].dtype)).item(), (
                    f"{bits}-bit core: {k} differs from mlx-lm's"
                )
            settings = SamplingSettings(max_tokens=2, temp=0.0)
            assert len(list(Generator(sm).generate([1, 2, 3], settings, lambda: False, GenerationSummary()))) == 2
        finally:
            sm.close()


def test_at_least_twelve_architectures_stream() -> None:
    if len(STREAMED) + len(NOT_YET) < len(ARCHS):
        pytest.skip("only part of the registry ran")
    assert len(STREAMED) >= 12, f"only {sorted(STREAMED)} stream"


def supported_block(streamed: dict[str, str], not_yet: dict[str, str]) -> str:
    """README's list of architectures, as tests/test_registry.py found them."""
    lines = [
        BEGIN,
        f"Measured by `tests/test_registry.py` on mlx-lm {mlx_lm.__version__}: each architecture (mlx-lm model "
        "module) below streamed a tiny repo with its experts in the layout shown, token for token as "
        "mlx-lm generates it.",
        "",
        "| mlx-lm module | experts stored as |",
        "|---|---|",
        *(f"| `{arch}` | {streamed[arch]} |" for arch in sorted(streamed)),
        "",
        "Not yet:",
        "",
        *(f"- `{arch}`: {_one_line(not_yet[arch])}" for arch in sorted(not_yet)),
        END,
    ]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().replace("|", "\\|")


def test_readme_lists_the_architectures_that_stream() -> None:
    if len(STREAMED) + len(NOT_YET) < len(ARCHS):
        pytest.skip("only part of the registry ran")
    block = supported_block(STREAMED, NOT_YET)
    text = README.read_text()
    current = re.search(re.escape(BEGIN) + ".*?" + re.escape(END), text, re.S)
    assert current, f"README.md has no {BEGIN} ... {END} block"
    if os.environ.get("EXPERTMESH_UPDATE_README") == "1":
        README.write_text(text.replace(current.group(0), block))
        return
    assert current.group(0) == block, (
        "README.md's list of supported architectures differs from what tests/test_registry.py measured: "
        "run `EXPERTMESH_UPDATE_README=1 python -m pytest tests/test_registry.py` and review the diff"
    )
