"""The streaming engine against its oracle, mlx-lm itself on the whole upstream repo.

Every arch, from every tier (Hub with a cold disk, a warm disk, a one-byte RAM budget that
evicts every expert): the same greedy tokens as `mlx_lm.stream_generate`, and the same last
logits over one forward pass of prompt + generated tokens. Then what a conversation needs:
two chat turns continue the cache (KDA recurrent state and MLA KV alike), seeded sampling is
reproducible and equal to mlx-lm's, and stopping between tokens leaves a usable cache.

Logit tolerances (max |Δ| of the last position's logits, streamed vs mlx-lm, one forward pass
of prompt + 24 generated tokens, no cache): measured on CPU (MLX 0.32.4, mlx-lm 0.32.2) the
difference is exactly 0.0 for every arch and prompt: the streamed blocks run each expert's
rows through the same MLX matmul kernels as mlx-lm's layers. We allow 1e-4 for float32 logits
(qwen3_moe on CPU) and 2**-5 for bfloat16 logits (two bf16 ulps at these logits' magnitude,
|logit| < 4), room for a backend (Metal) that tiles per-expert matmuls differently. A real regression is far
larger: the wrong experts in just the last MoE layer moved these logits by 0.46-1.05, and one
wrong expert for a few tokens by 0.23.
"""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from repos import tiny_id

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import ARCHS
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.chat import ChatSession
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.streamed_model import StreamedModel
from tests.store_calls import take_layer

LOGIT_TOLERANCE = {mx.float32: 1e-4, mx.bfloat16: 2**-5}  # measured: 0.0 everywhere (see above)
PROMPTS = ("hello experts", "The quick brown fox", "for layer in range")
MAX_TOKENS = 24
GREEDY = SamplingSettings(max_tokens=MAX_TOKENS, temp=0.0, top_p=1.0, seed=None)
CHAT = SamplingSettings(max_tokens=12, temp=0.0, top_p=1.0, seed=None)
CHAT_ARCHS = ["kimi_k3", "deepseek_v3"]  # KDA recurrent state + MLA; attention (MLA) only
TURN1, TURN2 = "hello! tell me a story.", "what is a mixture of experts?"


def _open(arch: str, home: Path, ram_budget: str = "50%", prefetch: bool = True) -> StreamedModel:
    return open_model(tiny_id(arch), home=home, store=StoreConfig(ram_budget=ram_budget, prefetch=prefetch, fill=False))


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory):
    """arch -> a StreamedModel (RAM 50 %) on its own pulled home, opened once per module."""
    opened: dict[str, StreamedModel] = {}

    def get(arch: str) -> StreamedModel:
        if arch not in opened:
            home = tmp_path_factory.mktemp(f"home-{arch}")
            pulled_home(arch, home)
            opened[arch] = _open(arch, home)
        return opened[arch]

    yield get
    for sm in opened.values():
        sm.close()


# -- helpers ---------------------------------------------------------------------------------


def _mlx_lm_tokens(model, tokenizer, ids: list[int], max_tokens: int, sampler=None, prompt_cache=None) -> list[int]:
    """Token ids mlx-lm generates (its last response carries the EOS token, which is no output)."""
    out = []
    for r in mlx_lm.stream_generate(
        model,
        tokenizer,
        mx.array(ids),
        max_tokens=max_tokens,
        sampler=sampler or make_sampler(0.0),
        prompt_cache=prompt_cache,
    ):
        if r.finish_reason == "stop":
            break
        out.append(r.token)
    return out


def _generate(
    sm: StreamedModel, ids: list[int], settings: SamplingSettings = GREEDY, should_stop=lambda: False
) -> tuple[list[int], GenerationSummary]:
    summary = GenerationSummary()
    tokens = [t.id for t in Generator(sm).generate(ids, settings, should_stop, summary)]
    return tokens, summary


def _kv_length(cache: list) -> int:
    """Tokens an mlx-lm prompt cache holds, from its attention layers (KDA state has no length)."""
    lengths = [c.offset for c in cache if isinstance(getattr(c, "offset", None), int)]
    assert lengths, "no attention layer cache with an offset: cannot tell what mlx-lm's cache holds"
    return max(lengths)


def _mlx_lm_second_turn(
    model, tokenizer, prompt1: list[int], cached1: list[int], fed2: list[int], max_tokens: int
) -> list[int]:
    """Turn 2 as mlx-lm makes it when it continues its own prompt cache over the same tokens.

    Turn 1 asks mlx-lm for exactly the reply tokens our cache holds; its pipelined step also
    feeds the last token it returns, so its cache then holds what ours does.
    """
    cache = make_prompt_cache(model)
    assert len(cached1) >= 1, "turn 1 kept no reply token in the cache; the comparison needs one"
    first = _mlx_lm_tokens(model, tokenizer, prompt1, len(cached1), prompt_cache=cache)
    assert first == cached1, "mlx-lm's turn 1 differs from ours: the oracle's cache would hold other tokens"
    assert _kv_length(cache) == len(prompt1) + len(cached1)
    return _mlx_lm_tokens(model, tokenizer, fed2, max_tokens, prompt_cache=cache)


def _render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _cached(reply: list[int], summary: GenerationSummary) -> list[int]:
    """The reply tokens a Generator's cache holds: all after an EOS, else all but the last."""
    return reply if summary.stop_reason == "eos" else reply[:-1]


# -- 1-3: every arch, every tier -------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tokens_and_logits_equal_mlx_lm_from_hub_disk_and_tiny_ram(
    pulled_home, arch: str, hub: HubServer, oracle, tmp_path: Path
) -> None:
    ref, ref_tok = oracle.load(arch)
    prompts = [ref_tok.encode(p) for p in PROMPTS]
    expected = [_mlx_lm_tokens(ref, ref_tok, ids, MAX_TOKENS) for ids in prompts]
    for p, exp in zip(PROMPTS, expected):
        assert len(exp) == MAX_TOKENS, f"mlx-lm stopped {p!r} after {len(exp)} tokens: pick a prompt without early EOS"
    pulled_home(arch, tmp_path)

    # 1. cold: a fresh home, so every expert's first use comes from the Hub
    cold = _open(arch, tmp_path)
    try:
        for n, (p, ids, exp) in enumerate(zip(PROMPTS, prompts, expected)):
            assert cold.tokenizer.encode(p) == ids
            tokens, summary = _generate(cold, ids)
            assert tokens == exp, f"cold cache, prompt {p!r}"
            assert summary.stop_reason == "length" and summary.generated_tokens == MAX_TOKENS
            # nothing was on disk before this model fetched it, but a wasted guess's bytes wait there
            assert summary.experts.uses["disk"] <= cold.store.stats.prefetch["wasted"]
            if n == 0:
                assert summary.experts.uses["hub"] > 0
            full = mx.array(ids + tokens)[None]
            got, want = cold.model(full)[0, -1], ref(full)[0, -1]
            assert got.dtype == want.dtype
            diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
            print(
                f"{arch} {p!r}: max |logit diff| {diff:.3g} ({want.dtype}, tolerance {LOGIT_TOLERANCE[want.dtype]:.3g})"
            )
            assert diff <= LOGIT_TOLERANCE[want.dtype], f"{arch} {p!r}: logits differ by {diff}"
        stats = cold.store.stats  # each Hub fetch, demanded or guessed, was kept on disk
        assert 0 < stats.uses["hub"] <= len(cold.disk) <= stats.uses["hub"] + stats.prefetch["issued"]
    finally:
        cold.close()

    # 2. warm disk: a new model (its own, empty RAM tier) on the same home never asks the Hub
    requests_before = hub.stats()["requests"]
    warm = _open(arch, tmp_path, prefetch=False)  # a guess may name an expert no run used yet: that one is new
    try:
        disk_uses = 0
        for p, ids, exp in zip(PROMPTS, prompts, expected):
            tokens, summary = _generate(warm, ids)
            assert tokens == exp, f"warm disk, prompt {p!r}"
            assert summary.experts.uses["hub"] == 0
            disk_uses += summary.experts.uses["disk"]
        assert disk_uses > 0
        assert hub.stats()["requests"] == requests_before, "a warm-disk generation sent requests to the Hub"
    finally:
        warm.close()

    # 3. a one-byte RAM budget: every expert is evicted as soon as it is stored
    tiny = _open(arch, tmp_path, ram_budget="1")
    try:
        assert tiny.store.ram.budget_bytes == 1
        for p, ids, exp in zip(PROMPTS, prompts, expected):
            tokens, summary = _generate(tiny, ids)
            assert tokens == exp, f"RAM budget of 1 byte, prompt {p!r}"
            assert summary.experts.uses["ram"] == 0 and summary.experts.uses["disk"] > 0
            assert summary.experts.uses["hub"] == 0
        assert tiny.store.ram.evictions > 0 and len(tiny.store.ram) == 0
    finally:
        tiny.close()


# -- 4: chat ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_turns(models, oracle):
    """arch -> what two greedy chat turns did, run once per module."""
    done: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in done:
            sm = models(arch)
            session = ChatSession(Generator(sm))
            s1, s2 = GenerationSummary(), GenerationSummary()
            reply1 = [t.id for t in session.reply(TURN1, CHAT, summary=s1)]
            after1 = list(session.messages)
            history1 = list(session.generator.history)
            reply2 = [t.id for t in session.reply(TURN2, CHAT, summary=s2)]
            done[arch] = dict(
                session=session,
                reply1=reply1,
                reply2=reply2,
                s1=s1,
                s2=s2,
                after1=after1,
                history1=history1,
                history2=list(session.generator.history),
            )
        return done[arch]

    return get


@pytest.mark.parametrize("arch", CHAT_ARCHS)
def test_second_chat_turn_continues_the_cache(arch: str, two_turns, oracle) -> None:
    ref, tok = oracle.load(arch)
    t = two_turns(arch)
    session, reply1, reply2 = t["session"], t["reply1"], t["reply2"]
    assert session.rebuilds == 0, "turn 2 rebuilt the cache instead of continuing it"
    assert len(reply1) == len(reply2) == CHAT.max_tokens  # no early EOS: both turns ran their length
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]

    # Turn 1 is a fresh mlx-lm run on the rendered first message.
    rendered1 = _render(tok, [{"role": "user", "content": TURN1}])
    prompt1 = tok.encode(rendered1)
    assert reply1 == _mlx_lm_tokens(ref, tok, prompt1, CHAT.max_tokens)

    # What the cache holds: turn 1's tokens and reply tokens as fed, then only the text that is
    # new in turn 2's rendering (the reply's last token, the end of turn, the new message).
    cached1, cached2 = _cached(reply1, t["s1"]), _cached(reply2, t["s2"])
    assert t["history1"] == prompt1 + cached1
    seen = rendered1 + tok.decode(cached1)
    rendered2 = _render(tok, [*t["after1"], {"role": "user", "content": TURN2}])
    assert rendered2.startswith(seen)
    fed2 = tok.encode(rendered2[len(seen) :], add_special_tokens=False)
    assert t["history2"] == prompt1 + cached1 + fed2 + cached2

    # Turn 2 equals mlx-lm continuing its own prompt cache over exactly those tokens.
    assert reply2 == _mlx_lm_second_turn(ref, tok, prompt1, cached1, fed2, CHAT.max_tokens)


# -- 5: sampling -----------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_equals_mlx_lm(models, oracle) -> None:
    sm = models("kimi_k3")
    ref, tok = oracle.load("kimi_k3")
    ids = tok.encode("Once upon a time")

    def sampled(seed: int) -> list[int]:
        tokens, summary = _generate(sm, ids, SamplingSettings(max_tokens=MAX_TOKENS, temp=0.8, top_p=0.9, seed=seed))
        assert summary.stop_reason == "length"
        return tokens

    seven, seven_again, eight = sampled(7), sampled(7), sampled(8)
    assert seven == seven_again
    assert len(seven) == len(eight) == MAX_TOKENS
    assert seven != eight  # 24 draws at temperature 0.8: equal sequences would mean the seed is ignored
    assert seven != _generate(sm, ids)[0]  # and the sampler really sampled

    mx.random.seed(7)
    assert seven == _mlx_lm_tokens(ref, tok, ids, MAX_TOKENS, sampler=make_sampler(0.8, 0.9))


# -- 6: stopping between tokens --------------------------------------------------------------


def test_stopping_after_three_tokens_then_the_next_turn_continues(models, oracle) -> None:
    sm = models("kimi_k3")
    ref, tok = oracle.load("kimi_k3")
    session = ChatSession(Generator(sm))
    reply1: list[int] = []
    s1 = GenerationSummary()
    for token in session.reply(TURN1, CHAT, should_stop=lambda: len(reply1) >= 3, summary=s1):
        reply1.append(token.id)
    assert s1.stop_reason == "interrupted" and s1.generated_tokens == len(reply1) == 3
    rendered1 = _render(tok, [{"role": "user", "content": TURN1}])
    prompt1 = tok.encode(rendered1)
    assert reply1 == _mlx_lm_tokens(ref, tok, prompt1, CHAT.max_tokens)[:3]
    assert session.messages[-1] == {"role": "assistant", "content": tok.decode(reply1)}
    after1 = list(session.messages)

    s2 = GenerationSummary()
    reply2 = [t.id for t in session.reply(TURN2, CHAT, summary=s2)]
    assert session.rebuilds == 0, "stopping between tokens must leave a cache the next turn can continue"
    assert s2.stop_reason in ("length", "eos") and len(reply2) >= 1
    cached1 = reply1[:-1]  # the last token of an interrupted reply is never fed
    seen = rendered1 + tok.decode(cached1)
    rendered2 = _render(tok, [*after1, {"role": "user", "content": TURN2}])
    assert rendered2.startswith(seen)
    fed2 = tok.encode(rendered2[len(seen) :], add_special_tokens=False)
    assert session.generator.history[: len(prompt1) + len(cached1) + len(fed2)] == prompt1 + cached1 + fed2
    assert reply2 == _mlx_lm_second_turn(ref, tok, prompt1, cached1, fed2, CHAT.max_tokens)


def test_ctrl_c_inside_a_turn_rebuilds_the_next_one_correctly(models, oracle) -> None:
    """A KeyboardInterrupt mid-turn leaves the cache unknown: the next turn rebuilds from the
    full rendering, and then equals a fresh mlx-lm run on it exactly."""
    sm = models("kimi_k3")
    ref, tok = oracle.load("kimi_k3")
    session = ChatSession(Generator(sm))
    reply1: list[int] = []

    def ctrl_c() -> bool:
        if len(reply1) >= 3:
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        for token in session.reply(TURN1, CHAT, should_stop=ctrl_c):
            reply1.append(token.id)
    assert len(reply1) == 3
    assert session.messages[-1] == {"role": "assistant", "content": tok.decode(reply1)}
    rendered2 = _render(tok, [*session.messages, {"role": "user", "content": TURN2}])

    reply2 = [t.id for t in session.reply(TURN2, CHAT)]
    assert session.rebuilds == 1
    prompt2 = tok.encode(rendered2)
    assert session.generator.history[: len(prompt2)] == prompt2
    assert reply2 == _mlx_lm_tokens(ref, tok, prompt2, CHAT.max_tokens)


# -- the expert store's single flight --------------------------------------------------------


def test_concurrent_demands_share_one_fetch_per_expert(pulled_home, hub: HubServer, tmp_path: Path) -> None:
    """Single flight under contention: several threads asking for overlapping experts (as
    concurrent requests on one node do) each get every expert, and the Hub sends each once.
    Also the regression of a deadlock that once hung warm-disk runs one time in three."""
    pulled_home("kimi_k3", tmp_path)
    sm = open_model(tiny_id("kimi_k3"), home=tmp_path, store=StoreConfig(ram_budget="50%", prefetch=False, fill=False))
    try:
        layer = sm.index.moe_layers[0]
        served_before = hub.stats()["bytes_served"]
        wanted = [list(range(i, i + 8)) for i in range(0, 16, 2)]  # 8 overlapping sets, 22 distinct experts
        results: list[dict] = [{} for _ in wanted]
        threads = [
            threading.Thread(target=lambda r=r, w=w: r.update(take_layer(sm.store, layer, w)), daemon=True)
            for r, w in zip(results, wanted)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)  # a deadlocked daemon thread only holds this throw-away store
        assert not any(t.is_alive() for t in threads), "layer_groups deadlocked"
        assert [sorted(r) for r in results] == wanted
        distinct = {e for w in wanted for e in w}
        sent = hub.stats()["bytes_served"] - served_before
        assert sent == sum(sm.index.expert(layer, e).nbytes for e in distinct)  # one fetch each, however many asked
        assert sm.store.stats.total_uses == sum(len(w) for w in wanted)
        assert not sm.store.flights.in_flight_count()  # single flight forgot the finished fetches
    finally:
        sm.close()
