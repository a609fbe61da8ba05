"""Speculative decoding against the plain path it must not change.

Models run in float32 here: mlx-lm's own bf16 forward pass of k tokens at once differs from k
one-token passes by up to 0.03 in the logits of these random tiny models (measured, MLX 0.32 CPU),
and at bf16 resolution their logits often tie, so an argmax may flip on numerics alone. In float32
the two differ by ~1e-6 and ties vanish: what is left to test is the algorithm (acceptance and
rollback), which must be exact.

Drafts are scripted from the plain path's own output with deliberate mistakes (`_Scripted`), so
every test sees full accepts, partial accepts and rejections — on K3 that exercises the KDA
state's restore-and-refeed, on the others mlx-lm's KV trim.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from repos import tiny_id

from expertmesh.assembly import open_model
from expertmesh.cli import main
from expertmesh.devtools.tiny import ARCHS
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.engine.speculative import (
    Draft,
    DraftController,
    ModelDraft,
    NgramDraft,
    SpeculationConfig,
    SpeculationError,
    SpeculationStats,
)
from expertmesh.node.engine.streamed_model import StreamedModel

PROMPT = "for i in range for i in range"
TOKENS = 24
GREEDY = SamplingSettings(max_tokens=TOKENS)
SPEC = SpeculationConfig(mode="ngram", initial_draft=3, warmup_rounds=1000)  # never switches off


class _Scripted:
    """Drafts the true continuation with a mistake after 0, 1, 2 ... correct tokens (cycling)."""

    def __init__(self, prompt_len: int, truth: list[int], vocab: int):
        self.prompt_len, self.truth, self.vocab, self.calls = prompt_len, truth, vocab, 0

    def propose(self, context: list[int], k: int, temp: float = 0.0, top_p: float = 1.0) -> Draft:
        done = len(context) - self.prompt_len  # generated tokens in the context
        true = self.truth[done : done + k]
        good = self.calls % (k + 1)
        self.calls += 1
        drafts = true[:good] + [(t + 1) % self.vocab for t in true[good:]]
        return Draft(drafts)


class _Echo:
    """Drafts the context's last k tokens: always a proposal, sometimes right."""

    def propose(self, context, k, temp=0.0, top_p=1.0) -> Draft:
        return Draft(context[-k:])


class _AlwaysWrong(_Scripted):
    def propose(self, context, k, temp=0.0, top_p=1.0) -> Draft:
        done = len(context) - self.prompt_len
        return Draft([(t + 1) % self.vocab for t in self.truth[done : done + k]])


@pytest.fixture(scope="module")
def models(pulled_home, hub, tmp_path_factory: pytest.TempPathFactory):
    """arch -> StreamedModel in float32 (see the module docstring), opened once per module."""
    opened: dict[str, StreamedModel] = {}

    def get(arch: str) -> StreamedModel:
        if arch not in opened:
            home = tmp_path_factory.mktemp(f"spec-{arch}")
            pulled_home(arch, home)
            sm = open_model(tiny_id(arch), home=home, store=StoreConfig(ram_budget="50%"))
            model_thread().call(_float32, sm.model)
            opened[arch] = sm
        return opened[arch]

    yield get
    for sm in opened.values():
        sm.close()


def _float32(model) -> None:
    """On the MLX thread, where the model runs: MLX evaluates an array only on the thread that made it."""
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())


def _next_logits(gen: Generator, token: int) -> mx.array:
    """The logits after feeding `token` to the generator's cache (run on the MLX thread)."""
    logits = gen._forward([token]).logits[0, -1]
    mx.eval(logits)
    return logits


def _run(gen: Generator, ids: list[int], settings: SamplingSettings = GREEDY):
    summary = GenerationSummary()
    toks = list(gen.generate(ids, settings, summary=summary))
    return [t.id for t in toks], [t.logprobs for t in toks], summary


def _vocab(sm: StreamedModel) -> int:
    return len(sm.tokenizer.get_vocab())


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_output_and_cache_equal_the_plain_path(arch: str, models) -> None:
    sm = models(arch)
    ids = sm.tokenizer.encode(PROMPT)
    for source in ("ngram", "scripted"):
        plain_gen = Generator(sm)
        plain, plain_lp, _ = _run(plain_gen, ids)
        assert len(plain) == TOKENS
        draft_source = _Scripted(len(ids), plain, _vocab(sm)) if source == "scripted" else None
        gen = Generator(sm, SPEC, draft_source=draft_source)
        got, got_lp, summary = _run(gen, ids)
        assert got == plain, f"{arch}, {source} drafts: speculation changed the greedy output"
        s = summary.speculation
        if source == "scripted":
            assert s.drafted > s.accepted > 0, f"{arch}: scripted drafts must be partly accepted, partly rejected"
            assert s.passes < TOKENS - 1, "accepted drafts must save forward passes"
        # rollback exactness: every token's distribution equals the plain path's, so the cache
        # after each rejected draft held exactly what the plain path's did
        diff = max(mx.abs(a - b).max().item() for a, b in zip(got_lp, plain_lp))
        assert diff < 1e-4, f"{arch}, {source}: logprobs differ by {diff} after rollbacks"
        # and when generation ends the cache is the plain path's: the next step agrees
        assert gen.history == plain_gen.history
        a, b = (model_thread().call(_next_logits, g, plain[-1]) for g in (gen, plain_gen))
        assert mx.abs(a - b).max().item() < 1e-4, f"{arch}, {source}: the cache after generation differs"


def test_a_second_turn_after_speculation_continues_the_cache(models) -> None:
    """A chat's second turn after speculation equals the plain path's second turn (K3: KDA)."""
    sm = models("kimi_k3")
    ids = sm.tokenizer.encode(PROMPT)
    plain_gen = Generator(sm)
    first, _, _ = _run(plain_gen, ids, SamplingSettings(max_tokens=10))
    second, _, _ = _run(plain_gen, ids[:3], SamplingSettings(max_tokens=10))
    spec_gen = Generator(sm, SPEC, draft_source=_Scripted(len(ids), first, _vocab(sm)))
    got1, _, _ = _run(spec_gen, ids, SamplingSettings(max_tokens=10))
    spec_gen._source = _Scripted(len(spec_gen.history) + 3, second, _vocab(sm))
    got2, _, s2 = _run(spec_gen, ids[:3], SamplingSettings(max_tokens=10))
    assert (got1, got2) == (first, second)
    assert spec_gen.history == plain_gen.history


def test_sampled_output_reproduces_with_a_seed(models) -> None:
    sm = models("deepseek_v3")
    ids = sm.tokenizer.encode(PROMPT)

    def sampled(seed: int) -> tuple[list[int], SpeculationStats]:
        tokens, _, summary = _run(
            Generator(sm, SPEC, draft_source=_Echo()),
            ids,
            SamplingSettings(max_tokens=TOKENS, temp=0.8, top_p=0.9, seed=seed),
        )
        return tokens, summary.speculation

    (a, sa), (b, _), (c, _) = sampled(7), sampled(7), sampled(8)
    assert a == b
    assert a != c  # 24 draws at temperature 0.8: equal sequences would mean the seed is ignored
    assert sa.drafted > 0, "the sampled path must have verified drafts"


def test_acceptance_rule_keeps_the_target_distribution() -> None:
    """Deterministic drafts: accept with p(x), else draw from p without x; the token's frequency
    must follow p (a 3-token vocabulary, 4000 draws; 5-sigma bounds, so it cannot flake)."""
    from expertmesh.node.engine.speculative import accept_drafts

    p = mx.array([0.5, 0.3, 0.2])
    logprobs = mx.log(mx.stack([p, p]))
    mx.random.seed(0)
    counts = [0, 0, 0]
    n = 4000
    for _ in range(n):
        j, nxt = accept_drafts(logprobs, Draft([1]), temp=1.0, top_p=1.0)
        counts[1 if j == 1 else nxt] += 1
        assert j == 1 or nxt != 1  # a rejected draft is never the correction
    for want, got in zip(p.tolist(), counts):
        sigma = (n * want * (1 - want)) ** 0.5
        assert abs(got - n * want) < 5 * sigma, (counts, p.tolist())


def test_acceptance_rule_with_draft_model_probabilities_keeps_the_target_distribution() -> None:
    """Drafts drawn from q != p, accepted with min(1, p/q), else the residual: the output is p."""
    from expertmesh.node.engine.speculative import accept_drafts

    p, q = mx.array([0.5, 0.3, 0.2]), mx.array([0.1, 0.6, 0.3])
    logprobs = mx.log(mx.stack([p, p]))
    mx.random.seed(1)
    counts = [0, 0, 0]
    n = 4000
    for _ in range(n):
        x = int(mx.random.categorical(mx.log(q)).item())
        j, nxt = accept_drafts(logprobs, Draft([x], [q]), temp=1.0, top_p=1.0)
        counts[x if j == 1 else nxt] += 1
    for want, got in zip(p.tolist(), counts):
        sigma = (n * want * (1 - want)) ** 0.5
        assert abs(got - n * want) < 5 * sigma, (counts, p.tolist())


def test_speculation_switches_itself_off_when_drafts_are_always_wrong(models) -> None:
    sm = models("qwen3_moe")
    ids = sm.tokenizer.encode(PROMPT)
    plain, _, _ = _run(Generator(sm), ids, SamplingSettings(max_tokens=48))
    cfg = SpeculationConfig(mode="ngram", warmup_rounds=2, cooldown_tokens=8)
    got, _, summary = _run(
        Generator(sm, cfg, draft_source=_AlwaysWrong(len(ids), plain, _vocab(sm))), ids, SamplingSettings(max_tokens=48)
    )
    s = summary.speculation
    assert got == plain
    assert s.accepted == 0 and s.switched_off >= 2, s  # off, probed again after its rest, off again
    assert s.verify_passes <= 6, f"speculation kept verifying hopeless drafts: {s}"
    assert s.passes == 47  # no pass beyond the plain path's: rejections cost rows, not passes


def test_controller_grows_shrinks_and_probes_again() -> None:
    cfg = SpeculationConfig(initial_draft=2, max_draft=4, warmup_rounds=2, cooldown_tokens=4, min_acceptance=0.5)
    c, s = DraftController(cfg), SpeculationStats()
    c.update(2, 2, 0, s)
    c.update(3, 3, 3, s)
    assert c.draft_length(6) == 4
    c.update(4, 1, 6, s)
    assert c.draft_length(8) == 2  # accepted + 1
    c.update(2, 0, 8, s)  # smoothed acceptance 0.42 < 0.5: off
    assert s.switched_off == 1 and c.draft_length(9) == 0 and c.draft_length(12) == 1  # rests 4, probes with 1
    c.update(1, 0, 12, s)  # a failed probe doubles the rest
    assert s.switched_off == 2 and c.draft_length(19) == 0 and c.draft_length(20) == 1
    c.update(1, 1, 20, s)  # a paying probe: speculation is back and grows
    assert s.switched_off == 2 and c.draft_length(21) == 2


def test_ngram_draft_proposes_the_latest_continuation() -> None:
    src = NgramDraft(ngram_max=3, ngram_min=2)
    assert src.propose([1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3], 2).tokens == [4, 5]  # latest match wins
    assert src.propose([1, 2, 3, 4], 3).tokens == []


def test_draft_model_mode_keeps_greedy_output(models, tiny_repos: dict[str, Path]) -> None:
    """`--draft` with mlx-lm's own load of the same tiny repo: most drafts are accepted."""
    sm = models("qwen3_moe")
    ids = sm.tokenizer.encode(PROMPT)
    plain, _, _ = _run(Generator(sm), ids)
    cfg = SpeculationConfig(mode="draft", draft_repo=str(tiny_repos["qwen3_moe"]), warmup_rounds=1000)
    gen = Generator(sm, cfg)
    assert isinstance(gen._source, ModelDraft)
    model_thread().call(_float32, gen._source.model)
    got, _, summary = _run(gen, ids)
    assert got == plain
    s = summary.speculation
    assert s.accepted >= s.drafted * 0.8 and s.passes_per_token < 0.6, s


def test_bad_speculation_flags_are_one_line_errors(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as e:
        main(["run", "x/y", "hi", "--speculate", "sometimes"])
    assert e.value.code == 2 and "--speculate" in capsys.readouterr().err
    with pytest.raises(SpeculationError, match="--draft REPO"):
        SpeculationConfig(mode="draft")
    assert main(["run", "x/y", "hi", "--speculate", "draft"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--draft REPO" in err and "Traceback" not in err


def test_drafted_and_accepted_reach_the_prometheus_counter(models) -> None:
    from expertmesh.node.observability.metrics import MetricsSources, NodeMetrics

    sm = models("deepseek_v3")
    ids = sm.tokenizer.encode(PROMPT)
    plain, _, _ = _run(Generator(sm), ids)
    metrics = NodeMetrics(MetricsSources(sm.store.stats, sm.store.ram, sm.disk))
    sm.token_observer, sm.store.stats.observer = metrics, metrics.observe_fetch  # as expertmesh/assembly.py does
    try:
        _, _, summary = _run(Generator(sm, SPEC, draft_source=_Scripted(len(ids), plain, _vocab(sm))), ids)
    finally:
        sm.token_observer = None
        sm.store.stats.observer = None
    s = summary.speculation
    assert s.drafted > s.accepted > 0
    for outcome, want in (("drafted", s.drafted), ("accepted", s.accepted)):
        got = metrics.registry.get_sample_value("expertmesh_speculative_tokens_total", {"outcome": outcome})
        assert got == want, outcome
    assert "passes per generated token" in "\n".join(summary.lines())


def test_sampling_speculation_cannot_verify_takes_the_plain_path(models) -> None:
    """Verification reproduces temperature and top-p over the model's own distribution only; a
    request with logits processors (penalties, bias) or min-p/top-k sampling runs without drafts,
    and gets exactly the plain path's tokens."""
    sm = models("kimi_k3")
    ids = sm.tokenizer.encode(PROMPT)
    for settings in (
        SamplingSettings(max_tokens=TOKENS, presence_penalty=2.0),
        SamplingSettings(max_tokens=TOKENS, temp=0.7, top_k=3, seed=5),
    ):
        plain, _, _ = _run(Generator(sm), ids, settings)
        got, _, summary = _run(Generator(sm, SPEC, draft_source=_Echo()), ids, settings)
        assert got == plain and summary.speculation is None
    _, _, summary = _run(Generator(sm, SPEC, draft_source=_Echo()), ids, GREEDY)
    assert summary.speculation is not None  # greedy still speculates
