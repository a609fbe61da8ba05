"""The prefix cache (node/engine/prefix_cache.py): a conversation's next turn, or another request
sharing a prefix, feeds only its new tokens and replies exactly as a fresh node would.

One architecture per kind of cache: kimi_k3 (KDA `ArraysCache` + MLA `KVCache`: checkpoints),
qwen3_moe (`KVCache`: trimmed), qwen3_next (Gated DeltaNet `ArraysCache` + `KVCache`) and gpt_oss
(sliding-window `RotatingKVCache`), the last two made by the registry in their upstream layout.
Registry models run in float32, as in tests/test_registry_features.py: what is checked is that a
resumed state is the state, not BF16 near ties.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from repos import KIMI_K3, QWEN3_MOE

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import registry
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.batching import BatchEngine
from expertmesh.node.engine.chat import message_ends
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.engine.prefix_cache import CHECKPOINT_EVERY, PrefixCache, PrefixSession, common_prefix
from expertmesh.node.engine.prefix_disk import PrefixDisk, prune_prefixes, stored_prefixes
from expertmesh.node.engine.streamed_model import StreamedModel
from expertmesh.node.hub import client as hub_client

TINY = {"kimi_k3": KIMI_K3, "qwen3_moe": QWEN3_MOE}
REGISTRY = ("qwen3_next", "gpt_oss")
SYSTEM = "You answer briefly. " + " ".join(f"rule {i}: be exact." for i in range(12))
TURNS = ("List three colours and why.", "Now three animals, please.", "Which of them is fastest?")
REPLY_TOKENS = 6
EVERY = 16  # checkpoint spacing: small, so a long prefill checkpoints in these tiny prompts too
MORE = 16  # what a turn may feed beyond its new tokens (the target)
# max |Δ| of a reply's log-probabilities, resumed vs fresh: tests/test_engine.py's logit tolerances.
# Resuming changes where prefill chunks end, which moves bf16 results by an ulp (2**-5 measured);
# a state restored one token off moved them by 0.6-1.0 (kimi_k3).
TOLERANCE = {mx.float32: 1e-4, mx.bfloat16: 2**-5}


@pytest.fixture(scope="module")
def registry_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("prefix-hub")
    for arch in REGISTRY:
        out = root / "registry" / arch
        out.mkdir(parents=True)
        registry.build(out, arch)
    with HubServer(root) as server, hub_client.using_endpoint(server.url):
        yield root / "registry"


@pytest.fixture(scope="module", params=[*TINY, *REGISTRY])
def model(request, pulled_home, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, StreamedModel]]:
    arch = request.param
    store = StoreConfig(ram_budget="50%", prefetch=False, fill=False)
    if arch in TINY:
        hub_root = request.getfixturevalue("hub_root")
        home = pulled_home(arch, tmp_path_factory.mktemp(f"prefix-{arch}"))
        with HubServer(hub_root) as server, hub_client.using_endpoint(server.url):
            sm = open_model(TINY[arch], home=home, store=store)
            yield arch, sm
            sm.close()
        return
    request.getfixturevalue("registry_hub")
    from expertmesh.node.hub.pull import pull

    home = tmp_path_factory.mktemp(f"prefix-{arch}")
    pull(f"registry/{arch}", home=home, progress=False)
    sm = open_model(f"registry/{arch}", home=home, store=store)
    model_thread().call(lambda: (sm.model.set_dtype(mx.float32), mx.eval(sm.model.parameters())))
    yield arch, sm
    sm.close()


def _prompt(sm: StreamedModel, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The prompt's tokens (through the chat template where the tokenizer has one) and where
    its messages end."""
    from expertmesh.node.engine.chat import chat_token_ids

    tok = sm.tokenizer
    if getattr(tok, "chat_template", None):
        ids = chat_token_ids(tok, messages)
        return ids, message_ends(tok, messages, ids)
    texts = [m["content"] for m in messages]
    ids = tok.encode(" ".join(texts))
    ends = [len(tok.encode(" ".join(texts[:k]))) for k in range(1, len(texts))]
    return ids, ends


def _generate(sm: StreamedModel, ids: list[int], prefix: PrefixSession | None = None) -> tuple[list, GenerationSummary]:
    summary = GenerationSummary()
    tokens = list(
        Generator(sm).generate(ids, SamplingSettings(max_tokens=REPLY_TOKENS), summary=summary, prefix=prefix)
    )
    return tokens, summary


def _conversation(sm: StreamedModel, cache: PrefixCache, space: str = "") -> list[tuple[int, int, int]]:
    """Three turns with the prefix cache, each checked against a fresh Generator on the same full
    prompt; returns (prompt tokens, new tokens, fed tokens) per turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    seen: list[int] = []  # what the conversation had fed and made before this turn
    out = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        ids, ends = _prompt(sm, messages)
        tokens, summary = _generate(sm, ids, cache.session(space, ids, ends))
        fresh, _ = _generate(sm, ids)
        assert [t.id for t in tokens] == [t.id for t in fresh], f"turn {len(out) + 1} differs from a fresh node's"
        gap = max(float(mx.max(mx.abs(a.logprobs - b.logprobs))) for a, b in zip(tokens, fresh))
        assert gap <= TOLERANCE[tokens[0].logprobs.dtype], f"turn {len(out) + 1} differs from a fresh node's ({gap})"
        assert summary.prompt_tokens + summary.cached_tokens == len(ids)
        new = len(ids) - common_prefix(np.asarray(seen), np.asarray(ids))
        out.append((len(ids), new, summary.prompt_tokens))
        seen = ids + [t.id for t in tokens]
        messages.append({"role": "assistant", "content": "".join(t.text for t in tokens)})
    return out


def test_each_turn_feeds_only_its_new_tokens_and_replies_as_a_fresh_node(model) -> None:
    arch, sm = model
    cache = model_thread().call(PrefixCache.for_model, sm.model, 1 << 30, EVERY)
    turns = _conversation(sm, cache)
    assert turns[0][2] == turns[0][0]  # nothing to reuse on the first turn
    for prompt, new, fed in turns[1:]:
        assert fed <= new + MORE, (arch, turns)
        assert fed < prompt
    assert cache.bytes <= cache.budget_bytes
    # another conversation with the same system prompt resumes after it
    ids, ends = _prompt(sm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}])
    tokens, summary = _generate(sm, ids, cache.session("", ids, ends))
    assert [t.id for t in tokens] == [t.id for t in _generate(sm, ids)[0]]
    assert summary.cached_tokens >= (ends[0] if ends else 0) - MORE and summary.cached_tokens > 0


def test_a_key_never_resumes_from_another_keys_prefix(model) -> None:
    arch, sm = model
    if arch not in ("kimi_k3", "qwen3_moe"):
        pytest.skip("isolation is the cache's bookkeeping, the same for every kind of state")
    cache = model_thread().call(PrefixCache.for_model, sm.model, 1 << 30, EVERY)
    ids, ends = _prompt(sm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}])
    _generate(sm, ids, cache.session("key-a", ids, ends))
    _, other = _generate(sm, ids, cache.session("key-b", ids, ends))
    assert other.cached_tokens == 0 and other.prompt_tokens == len(ids)
    _, same = _generate(sm, ids, cache.session("key-a", ids, ends))
    assert same.cached_tokens > 0


def test_a_batched_row_starts_from_a_stored_prefix(model) -> None:
    arch, sm = model
    if arch not in ("kimi_k3", "qwen3_moe"):
        pytest.skip("rows start from a cache as a Generator does; two kinds of state show it")
    cache = model_thread().call(PrefixCache.for_model, sm.model, 1 << 30, EVERY)
    engine = BatchEngine(sm, 2)
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
        ids, ends = _prompt(sm, messages)
        first = list(
            engine.generate(ids, SamplingSettings(max_tokens=REPLY_TOKENS), prefix=cache.session("", ids, ends))
        )
        messages += [
            {"role": "assistant", "content": "".join(t.text for t in first)},
            {"role": "user", "content": TURNS[1]},
        ]
        ids2, ends2 = _prompt(sm, messages)
        summary = GenerationSummary()
        settings = SamplingSettings(max_tokens=REPLY_TOKENS)
        second = list(engine.generate(ids2, settings, summary=summary, prefix=cache.session("", ids2, ends2)))
        fresh = list(engine.generate(ids2, settings))
    finally:
        engine.close()
    assert [t.id for t in second] == [t.id for t in fresh]
    new = len(ids2) - common_prefix(np.asarray(ids + [t.id for t in first]), np.asarray(ids2))
    assert summary.cached_tokens > 0 and summary.prompt_tokens <= new + MORE


def test_a_checkpoint_restored_one_token_off_is_caught(model, monkeypatch) -> None:
    """The equality the tests above check is sharp enough to catch a state restored at the wrong
    position: a checkpoint filed one token short (its state holds one token more than it says)
    makes the resumed reply differ from a fresh node's."""
    arch, sm = model
    if arch != "kimi_k3":
        pytest.skip("one architecture with checkpoints shows the check's sharpness")
    put = PrefixCache.put

    def off_by_one(self, space, tokens, cache, **options):
        return put(self, space, tokens[:-1], cache, **options)

    monkeypatch.setattr(PrefixCache, "put", off_by_one)
    cache = model_thread().call(PrefixCache.for_model, sm.model, 1 << 30, EVERY)
    with pytest.raises(AssertionError, match="differs from a fresh node's"):
        _conversation(sm, cache)


def test_a_long_prefix_outlives_a_restart_and_a_damaged_file_is_never_used(model, tmp_path: Path) -> None:
    """A system prompt longer than the disk tier's threshold is not fed again after a restart (a new
    prefix cache over the same folder); a file cut short is dropped, and the request is served from
    scratch. The threshold is lowered from MIN_TOKENS so that a tiny model proves the tier in seconds."""
    arch, sm = model
    if arch != "kimi_k3":
        pytest.skip("one architecture with a state that cannot trim shows the disk tier")
    system, min_tokens = SYSTEM * 3, 160

    def ask(cache: PrefixCache, question: str) -> tuple[list, GenerationSummary, list, list[int]]:
        ids, ends = _prompt(sm, [{"role": "system", "content": system}, {"role": "user", "content": question}])
        tokens, summary = _generate(sm, ids, cache.session("", ids, ends))
        return tokens, summary, _generate(sm, ids)[0], ids

    def restarted() -> PrefixCache:
        disk = PrefixDisk(tmp_path / sm.commit, sm.commit, 1 << 30, min_tokens)
        return model_thread().call(PrefixCache.for_model, sm.model, 1 << 30, CHECKPOINT_EVERY, disk)

    _, _, _, ids = ask(restarted(), TURNS[0])
    stored = stored_prefixes(tmp_path)  # what `expertmesh cache --prefixes` lists
    assert len(ids) > min_tokens + 64 and stored and all(p.tokens >= min_tokens for p in stored)
    tokens, summary, fresh, ids = ask(restarted(), TURNS[1])
    assert summary.cached_tokens >= min_tokens and summary.prompt_tokens <= len(ids) - min_tokens
    assert [t.id for t in tokens] == [t.id for t in fresh]
    for path in (tmp_path / sm.commit).glob("*.safetensors"):  # damaged: cut in the middle of its arrays
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    tokens, summary, fresh, _ = ask(restarted(), TURNS[2])
    assert summary.cached_tokens == 0 and [t.id for t in tokens] == [t.id for t in fresh]
    assert not any(p.stat().st_size < 1024 for p in (tmp_path / sm.commit).glob("*.safetensors"))  # dropped
    assert prune_prefixes(tmp_path, 0) > 0 and not stored_prefixes(tmp_path)


def test_a_growing_conversation_renders_only_its_new_messages_for_its_checkpoints(model, monkeypatch) -> None:
    """Finding where each message ends renders each head of the conversation; a later request of
    the same conversation renders only the heads it has not seen (an agent's history is long), and
    finds the same ends as rendering every head afresh."""
    from expertmesh.node.engine import chat

    arch, sm = model
    if arch != "kimi_k3":
        pytest.skip("the template's rendering is the same bookkeeping for every kind of state")
    tok = sm.tokenizer
    chat._heads_by_tokenizer.pop(tok, None)  # what the module's other conversations rendered
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in TURNS:
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": f"About {turn}"}]
    real, rendered = chat.chat_token_ids, []

    def counted(*args, **kwargs):
        rendered.append(len(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(chat, "chat_token_ids", counted)
    ids = real(tok, messages[:-1])  # the last reply's request: everything before it
    before = message_ends(tok, messages[:-1], ids)
    assert rendered == list(range(1, len(messages)))
    rendered.clear()
    ids = real(tok, messages + [{"role": "user", "content": "And then?"}])
    ends = message_ends(tok, messages + [{"role": "user", "content": "And then?"}], ids)
    assert rendered == [len(messages), len(messages) + 1]  # the two new heads only
    chat._heads_by_tokenizer.pop(tok)  # afresh: every head rendered again
    assert message_ends(tok, messages + [{"role": "user", "content": "And then?"}], ids) == ends
    assert ends[: len(before)] == before and len(ends) > len(before)
