"""A core streamed from the SSD within a budget (node/engine/streamed_core.py): the resident core's
tokens, its reads counted in the summary and on /metrics, its memory within the budget plus one
layer, and a core file cut under it a clear error.

The tiny K3 is streamed in both layouts a core is pulled in: upstream BF16 (K3's sanitize fuses
q/k/v and folds MLA's kv_b, so some parameters are made from several stored tensors) and the
4-bit core `pull --core-bits 4` writes (every parameter stored as it is used)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from repos import KIMI_K3

from expertmesh.assembly import build_node
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import MetricsConfig, NodeConfig, StoreConfig
from expertmesh.node.engine.core_quantization import quantize_core
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.errors import DamagedModelError
from expertmesh.node.hub import local_models

PROMPT = "the core streams from the disk, layer by layer"
TOKENS = 6


@pytest.fixture(scope="module")
def homes(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny K3 pulled in BF16 (upstream layout) and with a 4-bit core."""
    out = {fmt: pulled_home("kimi_k3", tmp_path_factory.mktemp(f"streamed-{fmt}")) for fmt in ("bf16", "4-bit")}
    quantize_core(local_models.find_pulled(out["4-bit"], KIMI_K3), 4)
    return out


def _sample(text: str, name: str) -> float:
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _generate(home: Path, core_budget: str | None, metrics: bool = False):
    config = NodeConfig(KIMI_K3, home=home, core_budget=core_budget, store=StoreConfig(fill=False, prefetch=False))
    if metrics:
        config.metrics = MetricsConfig(port=0)
    node = build_node(config).start()
    try:
        sm = node.model
        summary = GenerationSummary()
        ids = sm.tokenizer.encode(PROMPT)
        tokens = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=TOKENS), summary=summary)]
        scraped = generate_latest(node.metrics.registry).decode() if metrics else ""
        return tokens, summary, sm.core_stream, node.memory, scraped
    finally:
        node.close()


@pytest.mark.parametrize("fmt", ["bf16", "4-bit"])
def test_a_streamed_core_generates_the_resident_cores_tokens_within_its_budget(fmt: str, homes) -> None:
    resident, _, none, plan, _ = _generate(homes[fmt], None)
    assert none is None and not plan.streamed  # the tiny core fits: held whole unless a budget says otherwise
    tokens, summary, core, plan, scraped = _generate(homes[fmt], "25%", metrics=True)
    assert plan.streamed and core is not None
    assert tokens == resident, f"{fmt}: streamed {tokens}, resident {resident}"
    layout, split = core.layout, core.split
    assert split.pinned == 0 and split.ahead >= 1  # a quarter of this core pins nothing: every layer is read
    # every forward pass read every streamed layer once (the prompt is two passes, as mlx-lm feeds it),
    # and at most `ahead` layers more were read for a pass that did not come
    passes = 2 + (TOKENS - 1)
    read = summary.core_read_bytes
    assert (
        passes * split.read_bytes_per_token
        <= read
        <= (passes + 1) * split.read_bytes_per_token  # and at most `ahead` layers of a pass that did not come
    )
    assert "core streamed from the SSD" in "\n".join(summary.lines())
    # memory: what it keeps, and the layer computing plus those being read, within budget + one layer
    budget = max(plan.core_held_bytes, layout.resident_bytes + layout.largest_layer_bytes)
    assert core.stats.peak_held_bytes <= budget + layout.largest_layer_bytes
    # /metrics counts the same reads (a layer read ahead for a pass that did not come may finish after it)
    assert 0 < summary.core_read_bytes <= _sample(scraped, "expertmesh_core_read_bytes_total") <= core.stats.read_bytes


def test_a_budget_that_holds_more_pins_the_first_layers_and_reads_less(homes) -> None:
    resident, *_ = _generate(homes["4-bit"], None)
    tokens, summary, core, plan, _ = _generate(homes["4-bit"], "90%")
    assert tokens == resident
    split = core.split
    assert 0 < split.pinned < len(core.layout.layer_bytes)
    assert split.read_bytes_per_token == sum(core.layout.layer_bytes[split.pinned :])  # 4-bit: read as held
    # the read ahead wraps around to the first streamed layer, never to a pinned one
    assert core.stats.peak_held_bytes <= max(plan.core_held_bytes, split.held_bytes)
    assert (
        summary.core_read_bytes
        <= (2 + TOKENS) * split.read_bytes_per_token
        < (2 + TOKENS - 1) * sum(core.layout.layer_bytes)
    )


def test_a_core_file_cut_under_a_streamed_core_is_a_clear_error(homes, tmp_path: Path) -> None:
    import shutil

    home = tmp_path / "home"
    shutil.copytree(homes["4-bit"], home)
    node = build_node(NodeConfig(KIMI_K3, home=home, core_budget="25%", store=StoreConfig(fill=False))).start()
    try:
        path = local_models.find_pulled(home, KIMI_K3)
        for f in path.glob("model*.safetensors"):
            os.truncate(f, f.stat().st_size // 2)  # after loading: what a disk error or a restore would leave
        sm = node.model
        with pytest.raises(DamagedModelError, match="expertmesh pull"):
            list(Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=2)))
    finally:
        node.close()
