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
    assert str(PromptExperts.parse("topp:0.9")) == "topp:0.9" and str(PromptExperts.parse("keep")) == "keep"
    for bad in ("fast", "budget", "budget:x", "topp:0", "topp:1.5", "held:3", "keep:2", "budget:-1"):
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


def test_the_api_says_an_approximate_prompt_in_its_usage_header_and_metric(
    pulled_home, hub: HubServer, tmp_path: Path
) -> None:
    import urllib.request

    import openai
    from nodes import api_server, serving
    from repos import KIMI_K3

    from expertmesh.coordinator.openai_api import SUBSTITUTED_HEADER
    from expertmesh.node.config import MetricsConfig

    home = pulled_home("kimi_k3", tmp_path / "home")
    probe = open_model(tiny_id("kimi_k3"), home=home, store=StoreConfig(ram_budget="0", prefetch=False, fill=False))
    expert_bytes = max(loc.nbytes for loc in probe.index.experts.values())
    probe.close()
    store = StoreConfig(ram_budget=str(4 * expert_bytes + 1), prefetch=False, fill=False)
    secret = "prompt-experts-secret"
    with serving(KIMI_K3, home, secret, node_id="approx", store=store, metrics=MetricsConfig("127.0.0.1", 0)) as node:
        api = api_server([node.rpc.address], secret, [KIMI_K3])
        try:
            client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)

            def complete(prompt: str, **extra):
                raw = client.completions.with_raw_response.create(
                    model=KIMI_K3, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
                )
                r = raw.parse()
                return int(raw.headers[SUBSTITUTED_HEADER]), r.usage.model_extra["prompt_expert_uses_substituted"]

            assert complete(WARM) == (0, 0)  # exact by default: said as 0
            header, field = complete(TEXT, prompt_experts="held")
            assert header == field > 0
            with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_server.port}/metrics", timeout=30) as m:
                text = m.read().decode()
            line = next(x for x in text.splitlines() if x.startswith("expertmesh_prompt_expert_uses_substituted_total"))
            assert float(line.split()[-1]) == header
            stream = client.completions.create(
                model=KIMI_K3,
                prompt=TEXT + " again",
                max_tokens=2,
                temperature=0,
                stream=True,
                extra_body={"prompt_experts": "held"},
            )
            last = list(stream)[-1]
            assert last.model_extra["prompt_expert_uses_substituted"] > 0
            with pytest.raises(openai.BadRequestError, match="prompt_experts"):
                client.completions.create(model=KIMI_K3, prompt="x", extra_body={"prompt_experts": "fastest"})
        finally:
            api.stop()


def test_run_says_how_many_prompt_expert_uses_were_substituted(
    home: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from expertmesh.cli import main

    monkeypatch.setenv("EXPERTMESH_HOME", str(home))
    argv = ["run", tiny_id("kimi_k3"), TEXT, "--no-discovery", "--no-fill", "--max-tokens", "1"]
    assert main([*argv, "--prompt-experts", "held"]) == 0
    captured = capsys.readouterr()
    assert "prompt expert uses substituted" in captured.out + captured.err
    assert main([*argv, "--prompt-experts", "exact"]) == 0
    captured = capsys.readouterr()
    assert "prompt expert uses substituted" not in captured.out + captured.err
    with pytest.raises(SystemExit):
        main([*argv, "--prompt-experts", "budget:soon"])
    assert "budget needs a number" in capsys.readouterr().err


def test_the_plan_of_each_mode_fetches_nothing_held_and_a_budget_within_its_seconds() -> None:
    from expertmesh.node.prompt_cost import PromptCost
    from expertmesh.node.prompt_mode_cost import mode_costs

    cost = PromptCost(128, 4, 64, 8, 1000, link_bytes_per_s=1e3, disk_bytes_per_s=1e5)
    exact, held, budget = mode_costs(cost, disk_share=0.25, budget_s=10)
    assert exact.link_bytes == pytest.approx(cost.union_bytes * 0.75) and held.link_bytes == 0
    assert budget.link_bytes == pytest.approx(10 * 1e3) and held.seconds < budget.seconds < exact.seconds
    cold = mode_costs(cost, disk_share=0.0, budget_s=10)
    assert {c.link_bytes for c in cold} == {cost.union_bytes}  # nothing held: every mode fetches


def test_an_approximate_prompts_prefix_is_never_served_to_an_exact_request(
    pulled_home, hub: HubServer, tmp_path: Path
) -> None:
    """The prefix cache on, experts streamed into a RAM budget of four: `held` substitutes, its
    prompt's states are stored, and the same conversation asked exactly afterwards reuses none of
    them and replies as a fresh node does; the approximate conversation reuses its own."""
    import openai
    from nodes import api_server, serving
    from repos import KIMI_K3

    probe = open_model(
        tiny_id("kimi_k3"),
        home=pulled_home("kimi_k3", tmp_path / "probe"),
        store=StoreConfig(ram_budget="0", prefetch=False, fill=False),
    )
    expert_bytes = max(loc.nbytes for loc in probe.index.experts.values())
    probe.close()
    store = StoreConfig(ram_budget=str(4 * expert_bytes + 1), prefetch=False, fill=False)
    secret = "prompt-experts-prefix-secret"
    messages = [{"role": "system", "content": "You answer in few words."}, {"role": "user", "content": TEXT}]

    def chat(node, content: list[dict], **extra):
        api = api_server([node.rpc.address], secret, [KIMI_K3])
        try:
            client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)
            return client.chat.completions.create(
                model=KIMI_K3, messages=content, max_tokens=6, temperature=0, extra_body=extra
            )
        finally:
            api.stop()

    home = pulled_home("kimi_k3", tmp_path / "approx")
    with serving(KIMI_K3, home, secret, node_id="approx-then-exact", store=store) as node:
        chat(node, [{"role": "user", "content": WARM}])  # a short prompt's experts now held
        approx = chat(node, messages, prompt_experts="held")
        assert approx.usage.model_extra["prompt_expert_uses_substituted"] > 0
        exact = chat(node, messages)
        assert exact.usage.model_extra["prompt_expert_uses_substituted"] == 0
        assert exact.usage.prompt_tokens_details.cached_tokens == 0
        again = chat(node, messages, prompt_experts="held")  # an approximate prefix is its own kind's to reuse
        assert again.usage.prompt_tokens_details.cached_tokens > 0
    home = pulled_home("kimi_k3", tmp_path / "fresh")
    with serving(KIMI_K3, home, secret, node_id="fresh-exact", store=store) as node:
        fresh = chat(node, messages)
    assert exact.choices[0].message.content == fresh.choices[0].message.content


def test_held_uses_what_only_a_household_peer_holds(
    pulled_home, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`held` counts the household's inventories: a node whose own tiers hold nothing, joined to a
    peer whose disk holds a short prompt's experts, fetches those from the peer instead of
    substituting them, and answers a `held` prompt as a lone node holding the same experts on its
    own disk does (same substitutions, same tokens), with no expert from the Hub."""
    from nodes import joined, serving
    from repos import KIMI_K3

    monkeypatch.setattr(generation, "PREFILL_STEP", STEP)
    probe = open_model(
        KIMI_K3, home=pulled_home("kimi_k3", tmp_path / "probe"), store=StoreConfig(ram_budget="0", fill=False)
    )
    expert_bytes = max(loc.nbytes for loc in probe.index.experts.values())
    ids, warm = probe.tokenizer.encode(TEXT), probe.tokenizer.encode(WARM)
    probe.close()
    ram = str(4 * expert_bytes + 1)
    alone = open_model(
        KIMI_K3,
        home=pulled_home("kimi_k3", tmp_path / "alone"),
        store=StoreConfig(ram_budget=ram, prefetch=False, fill=False),
    )
    try:
        _generate(alone, warm, "exact", 1)  # the short prompt's experts on its own disk
        want = _generate(alone, ids, "held", 1)
    finally:
        alone.close()
    secret = "prompt-experts-household-secret"
    store = StoreConfig(ram_budget=ram, prefetch=False, fill=False)
    with serving(KIMI_K3, pulled_home("kimi_k3", tmp_path / "peer"), secret, node_id="peer", store=store) as peer:
        _generate(peer.model, warm, "exact", 1)  # the same experts, on the peer's disk only
        client_store = StoreConfig(ram_budget=ram, disk_budget="0", prefetch=False, fill=False)
        client = joined(
            KIMI_K3,
            pulled_home("kimi_k3", tmp_path / "client"),
            secret,
            [peer.rpc.address],
            node_id="client",
            store=client_store,
        )
        try:
            got = _generate(client.model, ids, "held", 1)
            stats = client.store.stats
        finally:
            client.close()
    assert want[1].prompt_substituted > 0
    assert got[1].prompt_substituted == want[1].prompt_substituted and got[0] == want[0]
    assert stats.uses["peer"] > 0 and stats.bytes["hub"] == 0


def test_an_approximate_request_on_a_batching_node_says_so_and_its_prefix_serves_no_exact_one(
    pulled_home, hub: HubServer, tmp_path: Path
) -> None:
    """On a node that batches Generate calls (`serve --max-batch 4`), a `held` request (run by a
    Generator of its own beside the batch) says it is approximate in its usage, its header and the
    metric; the same conversation asked exactly afterwards goes through the batch, reuses none of
    the approximate prompt's stored states and says 0; a second `held` request reuses its own."""
    import openai
    from nodes import api_server, serving
    from repos import KIMI_K3

    from expertmesh.coordinator.openai_api import SUBSTITUTED_HEADER
    from expertmesh.node.config import MetricsConfig

    probe = open_model(
        KIMI_K3, home=pulled_home("kimi_k3", tmp_path / "probe"), store=StoreConfig(ram_budget="0", fill=False)
    )
    expert_bytes = max(loc.nbytes for loc in probe.index.experts.values())
    probe.close()
    store = StoreConfig(ram_budget=str(4 * expert_bytes + 1), prefetch=False, fill=False)
    secret = "prompt-experts-batch-secret"
    messages = [{"role": "system", "content": "You answer in few words."}, {"role": "user", "content": TEXT}]
    home = pulled_home("kimi_k3", tmp_path / "home")
    metrics = MetricsConfig("127.0.0.1", 0)
    with serving(KIMI_K3, home, secret, node_id="batching", store=store, metrics=metrics, max_batch=4) as node:
        assert node.service.batch is not None
        api = api_server([node.rpc.address], secret, [KIMI_K3])
        try:
            client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)

            def chat(content: list[dict], **extra):
                raw = client.chat.completions.with_raw_response.create(
                    model=KIMI_K3, messages=content, max_tokens=2, temperature=0, extra_body=extra
                )
                r = raw.parse()
                return r, int(raw.headers[SUBSTITUTED_HEADER]), r.usage.model_extra["prompt_expert_uses_substituted"]

            def metric(name: str) -> float:
                return node.metrics.registry.get_sample_value(name) or 0.0

            chat([{"role": "user", "content": WARM}])  # a short prompt's experts now held
            said = metric("expertmesh_prompt_expert_uses_substituted_total")
            steps = metric("expertmesh_batch_size_count")
            approx, header, field = chat(messages, prompt_experts="held")
            assert header == field > 0
            assert metric("expertmesh_prompt_expert_uses_substituted_total") == said + field
            assert metric("expertmesh_batch_size_count") == steps  # not the batch's: a Generator of its own
            exact, header, field = chat(messages)
            assert header == field == 0
            assert exact.usage.prompt_tokens_details.cached_tokens == 0
            assert metric("expertmesh_batch_size_count") > steps  # the exact request went through the batch
            assert (
                metric("expertmesh_prompt_expert_uses_substituted_total")
                == said + approx.usage.model_extra["prompt_expert_uses_substituted"]
            )
            again, _, _ = chat(messages, prompt_experts="held")  # an approximate prefix is its own kind's to reuse
            assert again.usage.prompt_tokens_details.cached_tokens > 0
        finally:
            api.stop()


def test_keep_fetches_nothing_and_leaves_its_dropped_choices_uncomputed(
    pulled_home, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`keep`: a prompt row keeps only its held experts, renormalised; no expert is fetched for the
    prompt, and its dropped choices take no rows in the layer's kernels, giving exactly the logits
    that computing them with weight 0 gives (what the mode means) for fewer rows computed."""
    import mlx.core as mx
    import numpy as np

    from expertmesh.node.engine import blocks, prefill
    from expertmesh.node.engine.model_thread import model_thread

    monkeypatch.setattr(generation, "PREFILL_STEP", STEP)
    home = pulled_home("kimi_k3", tmp_path / "home")
    probe = open_model(tiny_id("kimi_k3"), home=home, store=StoreConfig(ram_budget="0", fill=False))
    expert_bytes = max(loc.nbytes for loc in probe.index.experts.values())
    probe.close()
    sm = open_model(
        tiny_id("kimi_k3"),
        home=home,
        store=StoreConfig(ram_budget=str(4 * expert_bytes + 1), prefetch=False, fill=False),
    )
    rows = [0]
    switch = blocks.StreamingExperts._switch

    def counting(self, x, slots):
        rows[0] += int(np.prod(slots.shape))
        return switch(self, x, slots)

    monkeypatch.setattr(blocks.StreamingExperts, "_switch", counting)

    def prompt(mode: str) -> tuple[np.ndarray, int, int, GenerationSummary]:
        gen, summary = Generator(sm), GenerationSummary()
        gen._prompt_experts = (PromptExperts.parse(mode), summary)

        def run():
            before, rows[0] = sm.store.stats.snapshot(), 0
            last = gen._prefill(sm.tokenizer.encode(TEXT))
            logits = last.logits[:, -1, :].astype(mx.float32)
            mx.eval(logits)
            last.count_uses()
            return np.array(logits), sm.store.stats.since(before).bytes["hub"], rows[0]

        return (*model_thread().call(run), summary)

    try:
        _generate(sm, sm.tokenizer.encode(WARM), "exact", 1)  # a short prompt's experts now on disk
        kept, fetched, computed, summary = prompt("keep")
        by_groups = prefill._by_groups
        monkeypatch.setattr(prefill, "_by_groups", lambda *a: by_groups(*a[:7]))  # dropped choices computed, weight 0
        weighted, _, all_rows, _ = prompt("keep")
        held = prompt("held")
    finally:
        sm.close()
    assert fetched == 0 and held[1] == 0
    assert 0 < summary.prompt_substituted < summary.prompt_approx.uses
    assert np.array_equal(kept, weighted)
    assert computed < all_rows == held[2]  # held computes as many rows as the prompt routed
