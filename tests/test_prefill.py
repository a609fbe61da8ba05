"""A prompt longer than one prefill chunk, on a RAM budget below a layer's union: each of its
experts is fetched once (node/engine/prefill.py's layer-major prefill), and the tokens equal
mlx-lm's fed in the same chunks."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler
from repos import tiny_id

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine import generation
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.observability.routing_trace import read_trace

STEP = 8  # prefill chunk: the prompt below is several chunks long
TEXT = "the quick brown fox jumps over the lazy dog while experts stream from the hub layer by layer"


@pytest.mark.parametrize("arch", ["kimi_k3", "qwen3_moe"])
def test_a_prompt_of_several_chunks_fetches_each_expert_once_and_equals_mlx_lm(
    pulled_home, arch: str, hub: HubServer, oracle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, ref_tok = oracle.load(arch)
    ids = ref_tok.encode(TEXT)
    assert len(ids) > 3 * STEP
    want = [
        r.token
        for r in mlx_lm.stream_generate(
            ref, ref_tok, mx.array(ids), max_tokens=4, sampler=make_sampler(0.0), prefill_step_size=STEP
        )
    ]
    monkeypatch.setattr(generation, "PREFILL_STEP", STEP)
    pulled_home(arch, tmp_path)
    probe = open_model(tiny_id(arch), home=tmp_path, store=StoreConfig(ram_budget="0", prefetch=False, fill=False))
    expert_bytes = max(loc.nbytes for loc in probe.index.experts.values())
    probe.close()
    trace = tmp_path / "trace"
    # two experts of RAM: far below any layer's union, so a layer takes its experts in groups
    store = StoreConfig(ram_budget=str(2 * expert_bytes + 1), prefetch=False, fill=False, trace_path=trace)
    sm = open_model(tiny_id(arch), home=tmp_path, store=store)
    try:
        summary = GenerationSummary()
        generator = Generator(sm)
        seen: list = []
        generator.prefill_progress = seen.append
        out = [t.id for t in generator.generate(ids, SamplingSettings(max_tokens=1), summary=summary)]
        assert out == want[:1]
        # the progress `run` shows: every MoE layer in turn, each to its whole union, the bytes read
        layers = len(sm.blocks)
        ends = [p for p in seen if p.experts_done == p.experts_needed]
        assert [p.layer for p in ends] == list(range(layers)) and all(p.layers == layers for p in seen)
        assert len(seen) > layers  # the groups within a layer are reported too
        assert ends[-1].bytes_read == summary.experts.bytes["hub"] and ends[-1].eta_s == 0
        prompt_distinct = {a for a in read_trace(trace).accesses()}
        uses = summary.experts.uses
        # the prompt's passes routed to these experts; each came from the Hub once and from no other tier
        assert uses["hub"] == len(prompt_distinct), (uses, len(prompt_distinct))
        assert uses["disk"] == 0 and uses["peer"] == 0
        assert summary.experts.layers["streamed"] > 0
        # the rest of the reply, token by token, still equals mlx-lm's
        rest = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=4))]
        assert rest == want
    finally:
        sm.close()
