"""A prompt longer than one prefill chunk, on a RAM budget below a layer's union: each of its
experts is fetched once (node/engine/prefill.py's layer-major prefill), and the tokens equal
mlx-lm's fed in the same chunks."""

from __future__ import annotations

import json
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


def _on_two_experts_of_ram(pulled_home, arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The tiny `arch` pulled into `tmp_path`, opened with RAM for two experts (far below any
    layer's union, so a layer takes its experts in groups) and its routing traced; prefill
    chunks of STEP tokens. Returns (the model, its trace's path)."""
    monkeypatch.setattr(generation, "PREFILL_STEP", STEP)
    pulled_home(arch, tmp_path)
    probe = open_model(tiny_id(arch), home=tmp_path, store=StoreConfig(ram_budget="0", prefetch=False, fill=False))
    expert_bytes = max(loc.nbytes for loc in probe.index.experts.values())
    probe.close()
    trace = tmp_path / "trace"
    store = StoreConfig(ram_budget=str(2 * expert_bytes + 1), prefetch=False, fill=False, trace_path=trace)
    return open_model(tiny_id(arch), home=tmp_path, store=store), trace


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
    sm, trace = _on_two_experts_of_ram(pulled_home, arch, tmp_path, monkeypatch)
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


def test_a_layers_expert_outputs_are_let_go_before_the_next_layer_makes_its_own(
    pulled_home, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt's largest arrays are its expert outputs: every token's top-k rows at an expert
    layer's width, which the memory plan counts once (ModelSizes.prompt_bytes). Before, the prefill
    kept each layer's outputs for its chunks while the next layer made its own: at 4,096 tokens of
    K3's shape, 0.94 GB over the plan (docs/benchmarks.md, issue 46's sixth session)."""
    import weakref

    from expertmesh.node.engine import prefill

    sm, _ = _on_two_experts_of_ram(pulled_home, "kimi_k3", tmp_path, monkeypatch)
    made: list[list[weakref.ref]] = []  # per MoE layer: its chunks' outputs
    alive: list[int] = []  # of the layer before's outputs, as each layer starts
    real = prefill.run_layer

    def watched(block, parts):
        alive.append(sum(r() is not None for r in made[-1]) if made else 0)
        ys = real(block, parts)
        made.append([weakref.ref(y) for y in ys])
        return ys

    monkeypatch.setattr(prefill, "run_layer", watched)
    try:
        ids = sm.tokenizer.encode(TEXT)
        list(Generator(sm).generate(ids, SamplingSettings(max_tokens=1)))
    finally:
        sm.close()
    assert len(made) == len(sm.blocks) > 1 and all(len(m) > 2 for m in made)  # several chunks, several layers
    assert alive == [0] * len(made), alive


def test_checkpoints_inside_a_prompt_neither_split_its_experts_nor_move_its_state(
    pulled_home, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kimi_k3's KDA state cannot trim, so the prefix cache checkpoints a prompt at marks inside
    it. The state at each mark is taken as each layer passes it (engine/prefill_states.py): the
    prompt still fetches each of its experts once (checkpoints that split the prompt read 214
    of them again from disk here), and a request resuming from a checkpoint replies as a fresh
    node does."""
    from expertmesh.node.engine.model_thread import model_thread
    from expertmesh.node.engine.prefix_cache import PrefixCache

    sm, trace = _on_two_experts_of_ram(pulled_home, "kimi_k3", tmp_path, monkeypatch)
    try:
        ids = sm.tokenizer.encode(TEXT)
        cache = model_thread().call(PrefixCache.for_model, sm.model, 1 << 30, 5)  # marks off the chunks' ends
        summary = GenerationSummary()
        session = cache.session("", ids, [11])
        list(Generator(sm).generate(ids, SamplingSettings(max_tokens=1), summary=summary, prefix=session))
        marks = session.marks_within(0, len(ids))
        assert len(marks) >= 3 and any(m % STEP for m in marks), marks
        uses = summary.experts.uses
        assert uses["hub"] == len(set(read_trace(trace).accesses())) and uses["disk"] == 0, uses
        # shares the prompt up to just past its first mark, which is not a chunk's end: resumes there
        more = ids[: marks[0] + 2] + sm.tokenizer.encode(" and then the answer comes")
        summary = GenerationSummary()
        resumed = list(
            Generator(sm).generate(
                more, SamplingSettings(max_tokens=4), summary=summary, prefix=cache.session("", more, [])
            )
        )
        assert summary.cached_tokens == marks[0]
        fresh = list(Generator(sm).generate(more, SamplingSettings(max_tokens=4)))
        assert [t.id for t in resumed] == [t.id for t in fresh]
        # tests/test_prefix_cache.py's tolerance: where chunks end moves bf16 results by an ulp
        gap = max(float(mx.max(mx.abs(a.logprobs - b.logprobs))) for a, b in zip(resumed, fresh))
        assert gap <= 2**-5, gap
    finally:
        sm.close()


def test_run_shows_a_cold_prompts_progress_and_doctor_says_what_a_prompt_costs(
    home: Path, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from expertmesh.cli import main

    monkeypatch.setenv("EXPERTMESH_HOME", str(home))
    argv = ["run", tiny_id("kimi_k3"), TEXT, "--no-discovery", "--no-fill", "--max-tokens", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    progress = [line for line in err.splitlines() if line.startswith("prompt: MoE layer")]
    assert progress and "about 0 s left" in progress[-1], err  # every layer done: nothing left
    out = tmp_path / "plan.json"
    plan = ["doctor", "--plan", tiny_id("kimi_k3"), "--memory", "16GB", "--link", "1MB", "--disk-rate", "4MB"]
    assert main([*plan, "--prompt-tokens", "4", "--json", str(out)]) == 0
    few = json.loads(out.read_text())["prompt"]
    assert main([*plan, "--prompt-tokens", "4096", "--json", str(out)]) == 0
    many = json.loads(out.read_text())["prompt"]
    # a longer prompt's union is larger, at most every expert; cold is the link's time, warm the disk's
    assert 0 < few["union_bytes"] < many["union_bytes"]
    assert many["cold_s"] == pytest.approx(many["union_bytes"] / 1e6) and many["warm_s"] == pytest.approx(
        many["cold_s"] / 4
    )
    assert "a prompt of 4096 tokens" in capsys.readouterr().out


def test_the_expected_union_is_what_an_even_router_draws() -> None:
    import numpy as np

    from expertmesh.node.prompt_cost import expected_union

    rng = np.random.default_rng(0)
    experts, k, tokens = 64, 8, 12
    drawn = [len({e for _ in range(tokens) for e in rng.choice(experts, k, replace=False)}) for _ in range(400)]
    assert expected_union(experts, k, tokens) == pytest.approx(np.mean(drawn), rel=0.02)
    assert expected_union(experts, k, 10_000) == pytest.approx(experts)


def test_a_batching_nodes_prompt_of_several_chunks_fetches_each_expert_once_and_others_decode_between_its_layers(
    pulled_home, hub: HubServer, oracle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve`'s batch (node/engine/batching.py) prefills a joiner's prompt layer-major too: fed in
    its turns of 8 tokens chunk by chunk, each turn would read again what the last one evicted."""
    import threading

    from expertmesh.node.engine.batching import BatchEngine

    arch = "kimi_k3"
    ref, ref_tok = oracle.load(arch)
    ids = ref_tok.encode(TEXT)
    want = [
        r.token
        for r in mlx_lm.stream_generate(
            ref, ref_tok, mx.array(ids), max_tokens=3, sampler=make_sampler(0.0), prefill_step_size=STEP
        )
    ]
    sm, trace = _on_two_experts_of_ram(pulled_home, arch, tmp_path, monkeypatch)
    engine = BatchEngine(sm, max_batch=2, prefill_step=STEP)  # turns of a few tokens, as a batch feeds
    try:
        before = sm.store.stats.snapshot()
        out = [t.id for t in engine.generate(ids, SamplingSettings(max_tokens=1))]
        assert out == want[:1]
        # each of the prompt's experts came from the Hub once, none again from disk
        fetched = sm.store.stats.since(before).uses
        assert fetched["disk"] == 0 and fetched["peer"] == 0, fetched
        assert fetched["hub"] == len(set(read_trace(trace).accesses())), fetched

        # a row decoding meanwhile gets a token between the prompt's layers, and both keep their tokens
        short = ref_tok.encode("hello experts")
        alone = [t.id for t in Generator(sm).generate(short, SamplingSettings(max_tokens=14))]
        first, got, steps = threading.Event(), [], []

        def running() -> None:
            for t in engine.generate(short, SamplingSettings(max_tokens=14)):
                got.append(t.id)
                first.set()

        row = threading.Thread(target=running, daemon=True)
        row.start()
        assert first.wait(60)
        at_join = engine.steps
        joined = []
        for t in engine.generate(ids, SamplingSettings(max_tokens=3)):
            steps.append(engine.steps)
            joined.append(t.id)
        row.join(60)
        assert joined == want and got == alone
        assert steps[0] - at_join >= len(sm.blocks), (at_join, steps, len(got))  # a decode step a layer
    finally:
        engine.close()
        sm.close()
