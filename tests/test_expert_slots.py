"""Compute shaped for a GPU (engine/blocks.py over the RAM tier's slots): mlx-lm's own kernels
on resident experts, and no host sync a layer does not need. Syncs and kernels are read from
MLX's own graph (expertmesh/devtools/graph_counts.py), so they are counted as on a Mac."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.devtools.graph_counts import GraphCounter
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.hub import local_models
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex
from tests.store_calls import take_layer

ARCH, REPO_ID = "kimi_k3", KIMI_K3
PROMPT = "hello experts"
TOKENS = 8
LONG_PROMPT = "for layer in range of the model, every expert is asked " * 4  # over 64 rows of routing


@pytest.fixture(scope="module")
def home(pulled_home, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pulled_home(ARCH, tmp_path_factory.mktemp("slots-home"))


def _warm(sm) -> None:
    """Every expert of every layer into the RAM tier, as a block would place them."""
    for layer in sm.index.moe_layers:
        take_layer(sm.store, layer, [e for lay, e in sm.index.experts if lay == layer], routed=[])


def _decode_syncs(sm, ids: list[int], summary: GenerationSummary) -> tuple[list[int], float]:
    """Greedy tokens, and the host syncs per token after the first (the first is the prefill's).
    Each token's expert uses are counted by the time it is handed out (Generate streams them)."""
    tokens, marks = [], []
    before = sm.store.stats.snapshot()
    with GraphCounter() as counts:
        for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=TOKENS), summary=summary):
            tokens.append(t.id)
            marks.append(counts.syncs)
            seen = sm.store.stats.since(before).total_uses
    assert summary.stop_reason == "length" and seen == summary.experts.total_uses > 0
    return tokens, (marks[-1] - marks[0]) / (len(marks) - 1)


def test_a_model_whose_experts_all_fit_syncs_once_a_token_as_mlx_lm(home: Path, hub: HubServer, oracle) -> None:
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1GB", prefetch=False, fill=False))
    try:
        _warm(sm)
        assert sm.all_resident()
        ids = sm.tokenizer.encode(PROMPT)
        summary = GenerationSummary()
        tokens, syncs = _decode_syncs(sm, ids, summary)
    finally:
        sm.close()
    assert tokens == oracle.tokens(ARCH, ids, TOKENS)
    assert syncs == 1  # the token's own: no MoE layer read its routing on the host
    assert summary.experts.layers["streamed"] == 0 and summary.experts.layers["resident"] > 0
    assert summary.experts.uses["ram"] > 0  # resident uses are still counted, once the pass is evaluated
    assert any(line.startswith("all experts resident") for line in summary.lines())


def test_a_layer_that_must_fetch_syncs_once_and_its_guess_rides_on_it(home: Path, hub: HubServer, oracle) -> None:
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1", prefetch=True, fill=False))
    try:
        ids = sm.tokenizer.encode(PROMPT)
        summary = GenerationSummary()
        tokens, syncs = _decode_syncs(sm, ids, summary)
        layers = len(sm.blocks)
    finally:
        sm.close()
    assert tokens == oracle.tokens(ARCH, ids, TOKENS)
    assert syncs == layers + 1  # one per MoE layer (its routing, and the next layer's guess), one for the token
    assert summary.experts.layers["resident"] == 0
    assert not any(line.startswith("all experts resident") for line in summary.lines())


def _gather_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each `gather_qmm` call's `sorted_indices`, in order."""
    calls: list[bool] = []
    real = mx.gather_qmm

    def gather_qmm(*args, **kwargs):
        calls.append(bool(kwargs.get("sorted_indices", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(mx, "gather_qmm", gather_qmm)
    return calls


@pytest.mark.parametrize("resident", [False, True])
def test_a_prefill_of_64_rows_runs_the_sorted_kernels_switchglu_runs(
    resident: bool, home: Path, hub: HubServer, oracle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlx-lm's SwitchGLU sorts the rows by expert from 64 (token, expert) rows on and tells
    `gather_qmm` so; a streamed prefill takes the same kernels, cold or with every expert resident."""
    ref, tokenizer = oracle.load(ARCH)
    ids = tokenizer.encode(LONG_PROMPT)
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1GB", prefetch=False, fill=False))
    try:
        if resident:
            _warm(sm)
        calls = _gather_calls(monkeypatch)
        model_thread().call(lambda: mx.eval(sm.forward(mx.array(ids)[None], None).logits))
        ours = list(calls)
        calls.clear()
        model_thread().call(lambda: mx.eval(ref(mx.array(ids)[None])))
        theirs = list(calls)
        sm.count_open()
    finally:
        sm.close()
    assert len(ids) * 4 >= 64 and theirs and all(theirs)  # mlx-lm sorted every projection's call
    assert ours == theirs


def _expert_bytes(home: Path) -> int:
    index = ExpertIndex.load(local_models.find_index(home, REPO_ID) / INDEX_FILENAME)
    return max(loc.nbytes for loc in index.experts.values())


def test_experts_arriving_into_used_slots_never_copy_a_stack(home: Path, hub: HubServer, oracle) -> None:
    """An LRU tier that keeps two experts, two spare slots: every arrival is kept and written into
    one of the same few slots, each written in place (the stacks' buffers never move), and what
    comes out is mlx-lm's."""
    store = StoreConfig(
        ram_budget=str(2 * _expert_bytes(home)), ram_policy="lru", fetch_concurrency=2, prefetch=True, fill=False
    )
    sm = open_model(REPO_ID, home=home, store=store)
    try:
        ids = sm.tokenizer.encode(PROMPT)
        first = []
        tokens = []
        for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=TOKENS)):
            tokens.append(t.id)
            if not first:
                first = [model_thread().call(sm.store.ram.stack_buffers), sm.store.ram.slot_writes]
        buffers, writes = model_thread().call(sm.store.ram.stack_buffers), sm.store.ram.slot_writes
        capacity = sm.store.ram.capacity
    finally:
        sm.close()
    assert tokens == oracle.tokens(ARCH, ids, TOKENS)
    assert writes - first[1] > capacity  # slots were written again and again after the first token
    assert buffers == first[0]


@pytest.mark.parametrize("long", [False, True])
def test_experts_the_ram_tier_does_not_keep_run_from_their_decoded_arrays_never_written(
    long: bool, home: Path, hub: HubServer, oracle
) -> None:
    """A RAM tier that keeps nothing: every expert is read, used once and let go, in decode and in a
    prompt of several groups. None is written into a slot (a copy of the expert on the MLX thread
    that nothing reads again): its kernels read the arrays it was decoded into, and what comes out
    is mlx-lm's."""
    sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="1", prefetch=True, fill=False))
    try:
        ids = sm.tokenizer.encode(LONG_PROMPT if long else PROMPT)
        tokens = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=TOKENS))]
        writes, uses = sm.store.ram.slot_writes, sm.store.stats.total_uses
    finally:
        sm.close()
    assert tokens == oracle.tokens(ARCH, ids, TOKENS)
    assert uses > 0 and writes == 0
