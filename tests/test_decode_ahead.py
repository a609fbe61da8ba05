"""Decode built ahead (engine/generation.py `_plain`): with every expert resident, the next
token's pass is built and started before this token is read, as mlx-lm's `generate_step` does,
so on a GPU the host builds one graph while the device computes the other. What a user relies
on: the same tokens, the same expert uses counted per token, and a cache that ends exactly where
it would without it — the last token handed out not fed — however generation stops, so a
conversation continued afterwards is mlx-lm's.

Two tiny architectures cover both ways a pass is taken back: Kimi K3's KDA state is restored
from a snapshot (its MLA cache trimmed), Qwen3-MoE's KV cache is trimmed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from repos import KIMI_K3, QWEN3_MOE

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from tests.store_calls import take_layer

PROMPT = "hello experts"
TOKENS = 8
ARCHS = {"kimi_k3": KIMI_K3, "qwen3_moe": QWEN3_MOE}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def resident(request, pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(arch, a model of it with every expert in a RAM slot, forward calls built ahead so far)."""
    arch = request.param
    home = pulled_home(arch, tmp_path_factory.mktemp(f"ahead-{arch}"))
    sm = open_model(ARCHS[arch], home=home, store=StoreConfig(ram_budget="1GB", prefetch=False, fill=False))
    try:
        for layer in sm.index.moe_layers:
            take_layer(sm.store, layer, [e for lay, e in sm.index.experts if lay == layer], routed=[])
        assert sm.all_resident()
        ahead: list[int] = []
        forward = sm.forward

        def counted(inputs, cache, ledgers=None, rollback: bool = False):
            if rollback:  # only a pass built ahead keeps a way back: its token may never be fed
                ahead.append(int(inputs.size))
            return forward(inputs, cache, ledgers, rollback=rollback)

        sm.forward = counted  # type: ignore[method-assign]
        yield arch, sm, ahead
    finally:
        sm.close()


def _generate(gen: Generator, ids: list[int], n: int, summary: GenerationSummary | None = None) -> list[int]:
    return [t.id for t in gen.generate(ids, SamplingSettings(max_tokens=n), summary=summary)]


def _uses_closed_after(sm, ids: list[int], n: int) -> dict:
    """Expert uses the store counted for a generation its reader closed after `n` tokens."""
    before = sm.store.stats.snapshot()
    stream = Generator(sm).generate(ids, SamplingSettings(max_tokens=TOKENS))
    for _ in range(n):
        next(stream)
    stream.close()
    return sm.store.stats.since(before).uses


def test_decode_built_ahead_is_mlx_lms_and_counts_every_token_once(resident, oracle, monkeypatch) -> None:
    arch, sm, ahead = resident
    ids = sm.tokenizer.encode(PROMPT)
    ahead.clear()
    summary = GenerationSummary()
    tokens = _generate(Generator(sm), ids, TOKENS, summary)
    assert tokens == oracle.tokens(arch, ids, TOKENS)
    assert len(ahead) == TOKENS - 1  # every pass after the prefill's was built ahead, none beyond the last
    assert summary.passes_built_ahead == TOKENS - 1
    assert any("pass built while the one before computed" in line for line in summary.lines())
    ahead.clear()
    closed = _uses_closed_after(sm, ids, 3)
    assert ahead

    monkeypatch.setattr(Generator, "_builds_ahead", lambda self: False)
    ahead.clear()
    plain = GenerationSummary()
    assert _generate(Generator(sm), ids, TOKENS, plain) == tokens and not ahead
    # a pass built for a token never handed out is not counted: uses per token as without it
    assert summary.experts.uses == plain.experts.uses and summary.experts.total_uses > 0
    assert closed == _uses_closed_after(sm, ids, 3)


def test_a_conversation_continues_after_generation_stops_with_a_pass_built_ahead(resident, oracle) -> None:
    """Stopped by max_tokens, and closed early by its reader: either way the pass built for the
    next token is taken back, and the next call (its tokens follow the last one handed out)
    goes on exactly as one long greedy generation does."""
    arch, sm, ahead = resident
    ids = sm.tokenizer.encode(PROMPT)
    whole = oracle.tokens(arch, ids, TOKENS)

    gen = Generator(sm)
    first = _generate(gen, ids, 3)
    assert len(gen.history) == len(ids) + 2  # the third token handed out is not fed
    rest = _generate(gen, first[-1:], TOKENS - 3)
    assert first + rest == whole

    gen = Generator(sm)
    ahead.clear()
    stream = gen.generate(ids, SamplingSettings(max_tokens=TOKENS))
    early = [next(stream).id for _ in range(2)]
    assert ahead  # the third token's pass was in flight when the reader stopped
    stream.close()
    assert len(gen.history) == len(ids) + 1
    assert early + _generate(gen, early[-1:], TOKENS - 2) == whole


def test_the_context_limit_stops_at_the_same_token_built_ahead_or_not(resident, monkeypatch) -> None:
    """A pass is built ahead only where the token it feeds still fits the context: generation
    stops with "context" after the same tokens, and nothing past the limit entered the cache."""
    _, sm, ahead = resident
    ids = sm.tokenizer.encode(PROMPT)
    monkeypatch.setattr(sm, "context_limit", len(ids) + 4)
    runs = []
    for builds in (True, False):
        if not builds:
            monkeypatch.setattr(Generator, "_builds_ahead", lambda self: False)
        ahead.clear()
        gen, summary = Generator(sm), GenerationSummary()
        tokens = _generate(gen, ids, TOKENS, summary)
        runs.append((tokens, summary.stop_reason, len(gen.history), bool(ahead)))
    (built, reason, held, was_ahead), (serial, serial_reason, serial_held, _) = runs
    assert was_ahead and reason == serial_reason == "context"
    assert built == serial and held == serial_held < len(ids) + 4
