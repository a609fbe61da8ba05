"""What an approximate prompt (`--prompt-experts`) saves and what it costs, on the trained demo model.

For each mode and setting (node/engine/prompt_experts.py), against the exact prompt, in one run:
held-out text (the demo's validation docstrings, never trained on) is cut into prompts of
`prompt_tokens` tokens each followed by its next 64 tokens. Each prompt runs in a fresh home, cold
(no expert held) or with a share of every layer's experts on the disk (`disk_share`, drawn at
random, the same for every mode), on a RAM budget of a few experts, from a local Hub whose link is
throttled so that fetching shows in the time to first token. Measured per prompt:

- fetched_bytes: expert bytes from the Hub for the prompt and its first token; ttft_s: its time;
- then the 64 held-out tokens are fed one by one (decoding, always exact), and at each position
  the next-token distribution is compared with the exact prompt's: mean KL(p_exact || p_mode),
  greedy agreement (argmax equal), and perplexity of the held-out tokens.

`core_4bit_kl` is the 4-bit core's KL to BF16 on the same model and text (as
benchmarks/bench_core_bits.py measures it): the quality cost a user already accepts.

`json_valid_share`: with the grammar on (`response_format` json_schema), the first prompt's text
followed by a request for JSON is answered under each of the 20 schemas of
expertmesh/devtools/json_schemas.py (greedy, bounded), the prompt in the mode, decoding exact and
constrained; the share of answers that parse and validate (jsonschema). `json_same_share`: the share
equal to the exact prompt's answer, a finer view of the same cost. Both run in one fresh home per
mode and disk share, on an unthrottled link (what is timed is above; this counts answers).

    expertmesh bench --prompt-experts [--json FILE]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

DECODED = 64  # decoded tokens compared after each prompt
SETTINGS = ("exact", "held", "keep", "drop", "topp:0.9", "topp:0.75", "budget:0.02", "budget:0.05")
RAM_EXPERTS = 8  # the RAM budget, in experts: far below a layer's union, as on a Mac with K3
LINK_BYTES_PER_S = 4e6  # the throttled Hub: a tiny model's experts take as long to arrive as a big one's


def _open(home: Path, repo: str, expert_bytes: int):
    from expertmesh.assembly import open_model
    from expertmesh.node.config import StoreConfig

    store = StoreConfig(ram_budget=str(RAM_EXPERTS * expert_bytes), prefetch=False, fill=False)
    return open_model(repo, home=home, store=store)


def _put_on_disk(home: Path, repo: str, expert_bytes: int, share: float, seed: int) -> None:
    """`share` of each layer's experts fetched onto the disk (then the node is closed, RAM let go)."""
    sm = _open(home, repo, expert_bytes)
    try:
        rng = np.random.default_rng(seed)
        for block in sm.blocks:
            n = block.num_experts
            chosen = sorted(rng.choice(n, int(round(share * n)), replace=False).tolist())
            for group in sm.store.layer_groups(block.layer, chosen, routed=()):
                with group.placed():
                    pass
    finally:
        sm.close()


def _one(home: Path, repo: str, expert_bytes: int, prompt: list[int], follow: list[int], mode: str) -> dict:
    """One prompt in `mode`, then `follow` fed token by token: bytes, TTFT, every position's log-probs."""
    from expertmesh.node.config import PromptExperts
    from expertmesh.node.engine.generation import GenerationSummary, Generator
    from expertmesh.node.engine.model_thread import model_thread

    sm = _open(home, repo, expert_bytes)
    try:
        gen = Generator(sm)
        summary = GenerationSummary()
        # the prompt's pass as Generator.generate runs it, without sampling (the first token may be
        # an end of sequence, which generate would not yield): its log-probs, bytes and time
        gen._prompt_experts = (PromptExperts.parse(mode), summary)

        def prompt_pass() -> tuple[np.ndarray, float, int]:
            sm.count_open()
            before, t0 = sm.store.stats.snapshot(), time.perf_counter()
            last = gen._prefill(list(prompt))
            logits = last.logits[:, -1, :].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, keepdims=True)
            mx.eval(lp)
            last.count_uses()
            return np.array(lp).reshape(-1), time.perf_counter() - t0, sm.store.stats.since(before).bytes["hub"]

        first, ttft, fetched = model_thread().call(prompt_pass)
        rows = [first]

        def step(t: int) -> np.ndarray:
            one = gen._forward([t])
            one.commit()
            logits = one.logits[:, -1, :].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, keepdims=True)
            mx.eval(lp)
            one.count_uses()
            return np.array(lp).reshape(-1)

        for t in follow[:-1]:
            rows.append(model_thread().call(step, t))
        return {
            "fetched_bytes": fetched,
            "ttft_s": ttft,
            "substituted": summary.prompt_substituted,
            "uses": summary.prompt_approx.uses if summary.prompt_approx is not None else 0,
            "logprobs": np.stack(rows),
        }
    finally:
        sm.close()


def _json_answers(home: Path, repo: str, expert_bytes: int, prompt: list[int], mode: str) -> list[str | None]:
    """Each schema's constrained answer to `prompt` + the request for JSON, the prompt in `mode`
    (None where the answer did not close: the grammar ran out of tokens)."""
    from expertmesh.devtools.json_schemas import MAX_TOKENS, PROMPT, SCHEMAS
    from expertmesh.node.config import PromptExperts
    from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
    from expertmesh.node.engine.grammar import GrammarConstraint, response_format_grammar

    sm = _open(home, repo, expert_bytes)
    try:
        ids = list(prompt) + sm.tokenizer.encode(" " + PROMPT)
        out: list[str | None] = []
        for schema in SCHEMAS:
            grammar = response_format_grammar({"type": "json_schema", "json_schema": {"schema": schema}})
            settings = SamplingSettings(
                max_tokens=MAX_TOKENS,
                constraint=GrammarConstraint(sm.tokenizer, grammar),
                prompt_experts=PromptExperts.parse(mode),
            )
            summary = GenerationSummary()
            text = "".join(t.text for t in Generator(sm).generate(ids, settings, summary=summary))
            out.append(text + summary.trailing_text if summary.stop_reason == "eos" else None)
        return out
    finally:
        sm.close()


def _valid_share(answers: list[str | None]) -> float | None:
    """The share of answers that parse and validate against their schema; None without jsonschema
    (a test dependency, not the package's)."""
    import json

    try:
        import jsonschema
    except ImportError:
        return None
    from expertmesh.devtools.json_schemas import SCHEMAS

    valid = 0
    for text, schema in zip(answers, SCHEMAS):
        if text is None:
            continue
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
    return valid / len(answers)


def core_4bit_kl(pulled: Path, repo: str, work: Path, text: str, n_windows: int = 4) -> float:
    """The 4-bit core's mean KL(p_bf16 || p_4bit) over held-out windows, as benchmarks/bench_core_bits.py."""
    from expertmesh.assembly import open_model
    from expertmesh.devtools.tiny.demo_model import windows
    from expertmesh.node.config import StoreConfig
    from expertmesh.node.engine.core_quantization import quantize_core
    from expertmesh.node.hub import local_models

    bf16, four = work / "home-bf16", work / "home-4bit"  # copies: the pulled home stays without experts
    shutil.copytree(pulled, bf16)
    shutil.copytree(pulled, four)
    quantize_core(local_models.find_pulled(four, repo), 4, None)
    lps = []
    for home in (bf16, four):
        sm = open_model(repo, home=home, store=StoreConfig(ram_budget="100%", fill=False))
        try:
            batch = windows(sm.tokenizer.encode(text))[:n_windows]
            out = []
            for i in range(batch.shape[0]):
                logits = sm.model(batch[i : i + 1, :-1])[0].astype(mx.float32)
                out.append(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
            lps.append(np.concatenate(out))
        finally:
            sm.close()
    ref, q = lps
    return float((np.exp(ref) * (ref - q)).sum(-1).mean())


def run(
    prompt_lengths: tuple[int, ...] = (128,),
    disk_shares: tuple[float, ...] = (0.0, 0.25),
    settings: tuple[str, ...] = SETTINGS,
    prompts: int = 3,
    json_validity: bool = True,
) -> dict:
    from expertmesh.devtools.local_hub import HubServer
    from expertmesh.devtools.tiny.demo_model import DEMO_DIR, HELDOUT_FILE, make_demo_model
    from expertmesh.devtools.tiny.demo_model import REPO_ID as DEMO_REPO
    from expertmesh.node.engine import prompt_experts
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    work = Path(tempfile.mkdtemp(prefix="expertmesh-promptexperts-"))
    rows: list[dict] = []
    default_rate = prompt_experts.DEFAULT_LINK_BYTES_PER_S
    try:
        make_demo_model(work / "hub" / DEMO_REPO)
        text = (DEMO_DIR / HELDOUT_FILE).read_text()
        with HubServer(work / "hub") as hub, hub_client.using_endpoint(hub.url):
            pulled = work / "pulled"
            pull(DEMO_REPO, home=pulled, progress=False)
            probe = _open(pulled, DEMO_REPO, 1 << 20)
            ids = probe.tokenizer.encode(text)
            expert_bytes = max(loc.nbytes for loc in probe.index.experts.values())
            probe.close()
            kl4 = core_4bit_kl(pulled, DEMO_REPO, work, text)
            hub.knobs.bandwidth_bytes_per_s = LINK_BYTES_PER_S
            # a budget is seconds of this link: the rate a node measures once it has fetched, given
            # here since each prompt starts in a fresh process-wide store with nothing measured yet
            prompt_experts.DEFAULT_LINK_BYTES_PER_S = LINK_BYTES_PER_S
            for n in prompt_lengths:
                span = n + DECODED
                cuts = [(ids[i * span : i * span + n], ids[i * span + n : (i + 1) * span]) for i in range(prompts)]
                cuts = [c for c in cuts if len(c[1]) == DECODED]
                for share in disk_shares:
                    results: dict[str, list[dict]] = {}
                    for s in settings:
                        for k, (prompt, follow) in enumerate(cuts):
                            home = work / f"home-{n}-{share}-{s}-{k}".replace(":", "_")
                            shutil.copytree(pulled, home)
                            if share > 0:
                                _put_on_disk(home, DEMO_REPO, expert_bytes, share, seed=k)
                            results.setdefault(s, []).append(_one(home, DEMO_REPO, expert_bytes, prompt, follow, s))
                            shutil.rmtree(home, ignore_errors=True)
                    answers: dict[str, list[str | None]] = {}
                    if json_validity:  # answers are counted, not timed: the link unthrottled
                        hub.knobs.bandwidth_bytes_per_s = 0.0
                        for s in settings:
                            home = work / f"json-{n}-{share}-{s}".replace(":", "_")
                            shutil.copytree(pulled, home)
                            if share > 0:
                                _put_on_disk(home, DEMO_REPO, expert_bytes, share, seed=0)
                            answers[s] = _json_answers(home, DEMO_REPO, expert_bytes, cuts[0][0], s)
                            shutil.rmtree(home, ignore_errors=True)
                        hub.knobs.bandwidth_bytes_per_s = LINK_BYTES_PER_S
                    exact = results["exact"]
                    for s, got in results.items():
                        kls, agree, nll = [], [], []
                        for g, e, (_, follow) in zip(got, exact, cuts):
                            p, q = e["logprobs"], g["logprobs"]
                            kls.append((np.exp(p) * (p - q)).sum(-1))
                            agree.append(p.argmax(-1) == q.argmax(-1))
                            nll.append(-q[np.arange(len(follow)), follow])
                        mode, _, setting = s.partition(":")
                        rows.append(
                            {
                                "model": "demo",
                                "mode": mode,
                                "setting": setting or None,
                                "prompt_tokens": n,
                                "disk_share": share,
                                "fetched_bytes": float(np.mean([g["fetched_bytes"] for g in got])),
                                "ttft_s": float(np.mean([g["ttft_s"] for g in got])),
                                "kl_mean": float(np.concatenate(kls).mean()),
                                "greedy_agreement": float(np.concatenate(agree).mean()),
                                "ppl": float(np.exp(np.concatenate(nll).mean())),
                                "json_valid_share": _valid_share(answers[s]) if s in answers else None,
                                "json_same_share": float(
                                    np.mean([a == b for a, b in zip(answers[s], answers["exact"])])
                                )
                                if s in answers
                                else None,
                                "exact_fetched_bytes": float(np.mean([e["fetched_bytes"] for e in exact])),
                                "exact_ttft_s": float(np.mean([e["ttft_s"] for e in exact])),
                                "core_4bit_kl": kl4,
                                "substituted_share": float(
                                    sum(g["substituted"] for g in got) / max(1, sum(g["uses"] for g in got))
                                ),
                            }
                        )
    finally:
        prompt_experts.DEFAULT_LINK_BYTES_PER_S = default_rate
        shutil.rmtree(work, ignore_errors=True)
    return {
        "rows": rows,
        "prompts": prompts,
        "decoded": DECODED,
        "ram_experts": RAM_EXPERTS,
        "link_bytes_per_s": LINK_BYTES_PER_S,
        "load": os.getloadavg(),
        "not_measured": "k3-proportions rows",
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# the K3-proportioned rows: the bench repo `expertmesh bench --model k3-proportions --moe-layers 2
# --experts-per-layer 384` makes (17.5 MB experts), on its 100 MB/s link. A budget here is the same
# share of exact's fetch time as the demo's budget:0.02 is of its own (about a fifth), so that row
# carries that demo row's quality figures.
K3_SETTINGS = {"exact": "exact", "held": "held", "keep": "keep", "budget:20": "budget:0.02"}
K3_EXPERTS, K3_MOE_LAYERS = 384, 2


def run_k3(demo_rows: list[dict], prompt_tokens: int = 128, disk_share: float = 0.25, progress=print) -> list[dict]:
    """Exact, held, keep and budget on the K3-proportioned repo: a cold prompt of `prompt_tokens` held-out
    tokens with `disk_share` of each layer's experts on disk; bytes fetched and TTFT (the prompt's
    pass), each mode in a fresh copy of the same home. Quality figures are the demo's rows' for the
    same mode (K3_SETTINGS), at the same prompt length and disk share."""
    from expertmesh.devtools import bench_k3
    from expertmesh.devtools.local_hub import HubServer
    from expertmesh.devtools.tiny import k3_proportions
    from expertmesh.devtools.tiny.demo_model import DEMO_DIR, HELDOUT_FILE
    from expertmesh.node import constants
    from expertmesh.node.engine import prompt_experts
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    p = k3_proportions.Proportions(experts=K3_EXPERTS, moe_layers=K3_MOE_LAYERS)
    repo = f"{bench_k3.REPO_ID}-{p.moe_layers}x{p.experts}-{p.expert_bytes}"
    hub_root = constants.expertmesh_home() / "bench" / "hub"
    bench_k3._model_dir(hub_root, repo, p, progress)
    work = Path(tempfile.mkdtemp(prefix="expertmesh-promptexperts-k3-"))
    default_rate = prompt_experts.DEFAULT_LINK_BYTES_PER_S
    got: dict[str, dict] = {}
    try:
        with HubServer(hub_root) as hub, hub_client.using_endpoint(hub.url):
            prepared = work / "prepared"
            pull(repo, home=prepared, progress=False)
            probe = _open(prepared, repo, p.expert_bytes)
            ids = probe.tokenizer.encode((DEMO_DIR / HELDOUT_FILE).read_text())[:prompt_tokens]
            probe.close()
            progress(f"putting {disk_share:.0%} of each layer's experts on disk")
            _put_on_disk(prepared, repo, p.expert_bytes, disk_share, seed=0)
            hub.knobs.bandwidth_bytes_per_s = bench_k3.LINK_BYTES_PER_S
            prompt_experts.DEFAULT_LINK_BYTES_PER_S = bench_k3.LINK_BYTES_PER_S
            for s in K3_SETTINGS:
                home = work / f"home-{s}".replace(":", "_")
                shutil.copytree(prepared, home)
                progress(f"k3-proportions, {prompt_tokens} tokens, {s}")
                got[s] = _one(home, repo, p.expert_bytes, ids, [0], s)
                shutil.rmtree(home, ignore_errors=True)
    finally:
        prompt_experts.DEFAULT_LINK_BYTES_PER_S = default_rate
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for s, g in got.items():
        quality = next(
            (
                r
                for r in demo_rows
                if f"{r['mode']}{':' + r['setting'] if r['setting'] else ''}" == K3_SETTINGS[s]
                and r["prompt_tokens"] == prompt_tokens
                and r["disk_share"] == disk_share
            ),
            {},
        )
        mode, _, setting = s.partition(":")
        rows.append(
            {
                **{
                    k: quality.get(k)
                    for k in ("kl_mean", "greedy_agreement", "ppl", "json_valid_share", "core_4bit_kl")
                },
                "json_same_share": quality.get("json_same_share"),
                "model": "k3-proportions",
                "mode": mode,
                "setting": setting or None,
                "prompt_tokens": len(ids),
                "disk_share": disk_share,
                "fetched_bytes": float(g["fetched_bytes"]),
                "ttft_s": g["ttft_s"],
                "exact_fetched_bytes": float(got["exact"]["fetched_bytes"]),
                "exact_ttft_s": got["exact"]["ttft_s"],
                "substituted_share": g["substituted"] / max(1, g["uses"]),
                "quality_from": K3_SETTINGS[s],
            }
        )
    return rows


def print_table(doc: dict) -> None:
    print(
        f"{'':<4} {'mode':<7} {'setting':>7} {'tokens':>6} {'disk':>5} {'bytes/exact':>11} {'TTFT/exact':>10} "
        f"{'KL mean':>9} {'greedy':>7} {'ppl':>8} {'subst':>6} {'json ok':>7} {'json =':>6}"
    )
    for r in doc["rows"]:
        b = r["fetched_bytes"] / r["exact_fetched_bytes"] if r["exact_fetched_bytes"] else float("nan")
        t = r["ttft_s"] / r["exact_ttft_s"] if r["exact_ttft_s"] else float("nan")
        print(
            f"{r['model'][:4]:<4} {r['mode']:<7} {r['setting'] or '':>7} {r['prompt_tokens']:>6} {r['disk_share']:>5.2f} {b:>11.2f} "
            f"{t:>10.2f} {_num(r['kl_mean'], '.4f'):>9} {_num(r['greedy_agreement'], '.2%'):>7} {_num(r['ppl'], '.3f'):>8} "
            f"{r['substituted_share']:>6.1%} {_share(r['json_valid_share']):>7} {_share(r['json_same_share']):>6}"
        )
    if doc["rows"]:
        print(f"4-bit core KL to BF16 on the same model: {doc['rows'][0]['core_4bit_kl']:.4f}")
    print(f"not measured: {doc['not_measured']}")
    print(f"load average: {', '.join(f'{x:.2f}' for x in doc['load'])}")


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)
