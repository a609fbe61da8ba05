"""An approximate prompt (`--prompt-experts`, node/engine/prompt_experts.py): the prompt's rows use
experts this node holds instead of fetching, the count of substituted uses is said, decoding stays
exact, and the default changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from repos import tiny_id

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine import generation
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.prompt_experts import PromptExperts

STEP = 8
WARM = "the quick brown fox"
TEXT = "the quick brown fox jumps over the lazy dog while experts stream from the hub layer by layer"


def test_the_mode_parses_and_refuses_what_it_cannot_mean() -> None:
    assert PromptExperts.parse("exact").exact and PromptExperts.parse("").exact
    assert PromptExperts.parse("budget:2.5") == PromptExperts("budget", 2.5)
    assert str(PromptExperts.parse("topp:0.9")) == "topp:0.9"
    for bad in ("fast", "budget", "budget:x", "topp:0", "topp:1.5", "held:3", "budget:-1"):
        with pytest.raises(ValueError, match="prompt experts"):
            PromptExperts.parse(bad)


def _generate(sm, ids: list[int], mode: str, n: int = 4) -> tuple[list[int], GenerationSummary]:
    summary = GenerationSummary()
    settings = SamplingSettings(max_tokens=n, prompt_experts=PromptExperts.parse(mode))
    return [t.id for t in Generator(sm).generate(ids, settings, summary=summary)], summary


def test_held_substitutes_what_is_not_held_says_how_many_and_fetches_less(
    pulled_home, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(generation, "PREFILL_STEP", STEP)
    homes = {m: pulled_home("kimi_k3", tmp_path / m) for m in ("exact", "held")}
    got = {}
    for mode, home in homes.items():
        probe = open_model(tiny_id("kimi_k3"), home=home, store=StoreConfig(ram_budget="0", prefetch=False, fill=False))
        expert_bytes = max(loc.nbytes for loc in probe.index.experts.values())
        probe.close()
        store = StoreConfig(ram_budget=str(4 * expert_bytes + 1), prefetch=False, fill=False)
        sm = open_model(tiny_id("kimi_k3"), home=home, store=store)
        try:
            ids = sm.tokenizer.encode(TEXT)
            _generate(sm, sm.tokenizer.encode(WARM), "exact", 1)  # a short prompt's experts now on disk
            got[mode] = _generate(sm, ids, mode)
        finally:
            sm.close()
    (exact_ids, exact), (held_ids, held) = got["exact"], got["held"]
    assert exact.prompt_approx is None and exact.prompt_substituted == 0
    assert held.prompt_approx is not None
    count = held.prompt_approx
    # every MoE layer's prompt rows were counted, and some of their uses went to held experts instead
    assert count.uses == len(ids) * 4 * 5 and 0 < count.substituted < count.uses
    assert f"{count.substituted} of {count.uses} prompt expert uses substituted" in "\n".join(held.lines())
    assert held.experts.bytes["hub"] < exact.experts.bytes["hub"]
    assert len(held_ids) == len(exact_ids) == 4


def test_held_with_nothing_held_fetches_what_the_prompt_chose_and_equals_exact(
    pulled_home, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(generation, "PREFILL_STEP", STEP)
    out = {}
    for mode in ("exact", "held"):
        home = pulled_home("kimi_k3", tmp_path / mode)
        sm = open_model(tiny_id("kimi_k3"), home=home, store=StoreConfig(ram_budget="1", prefetch=False, fill=False))
        try:
            out[mode] = _generate(sm, sm.tokenizer.encode(TEXT), mode)
        finally:
            sm.close()
    assert out["held"][0] == out["exact"][0]
    assert out["held"][1].prompt_substituted == 0
