"""What a grammar (node/engine/grammar.py) costs a decode token, against no grammar, side by side in one run.

The trained demo model, every expert in RAM (the case where a token is cheapest, so where a mask
weighs most), greedy, `--tokens` decode tokens per generation, rounds alternating:
  - free: no grammar (end of text ignored, so it runs every token); its next pass is built while
    this one computes, as the plain path does whenever it can;
  - unpipelined: the constrained path with a constraint that masks nothing (no pass built ahead);
  - grammar: a json_schema (a string of at least 4,000 characters: never complete before
    `--tokens`, so it runs every token too), its mask applied before each sample; the pass is
    not built ahead, since the mask needs the token before it.
Per configuration: median decode ms per token (after the first token) over the rounds; the ratio
grammar/free is the issue's target (<= 1.10), grammar/unpipelined the mask's own share of it; the
same ratios of the fastest rounds, the least disturbed on a shared machine. Then the mask alone, per token, for the engines
that are installed: llguidance (used) and outlines-core (measured for the choice; xgrammar needs
torch and CUDA wheels, several GB, to install).

    python benchmarks/bench_grammar.py [--tokens 48] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny.demo_model import REPO_ID, make_demo_model
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.grammar import GrammarConstraint, response_format_grammar
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull

PROMPT = "Return the settings of the cache as JSON: "
SCHEMA = {"type": "string", "minLength": 4000}
# The masks alone compare engines on one small grammar that the generation's tokens also follow
# (outlines-core builds its index over the schema's regex: a 4,000-character minimum would take
# minutes to build).
MASK_SCHEMA = {"type": "string"}


def _grammar() -> str:
    return response_format_grammar({"type": "json_schema", "json_schema": {"schema": SCHEMA}})


class _AllowAll:
    """A constraint that masks nothing: the constrained path (no pass built ahead) without a mask."""

    def mask(self, logprobs):
        return logprobs

    def advance(self, token: int) -> None:
        pass


def _decode_ms(sm, ids: list[int], tokens: int, config: str) -> float:
    constraint = {"grammar": lambda: GrammarConstraint(sm.tokenizer, _grammar()), "unpipelined": _AllowAll}.get(
        config, lambda: None
    )()
    summary = GenerationSummary()
    settings = SamplingSettings(max_tokens=tokens, constraint=constraint)
    list(Generator(sm).generate(ids, settings, summary=summary))
    if summary.generated_tokens != tokens:
        raise RuntimeError(f"generated {summary.generated_tokens} tokens, not {tokens}")
    return 1000 * summary.decode_seconds / (tokens - 1)


def _llguidance_mask_us(sm, tokens: list[int]) -> tuple[float, float]:
    """(the engine's mask and step per token, applying the mask to a row of logits in MLX)."""
    import mlx.core as mx

    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"schema": MASK_SCHEMA}})
    c = GrammarConstraint(sm.tokenizer, grammar)
    t0 = time.perf_counter()
    for tok in tokens:
        c.matcher.compute_bitmask()
        c.advance(tok)
    engine = 1e6 * (time.perf_counter() - t0) / len(tokens)
    c = GrammarConstraint(sm.tokenizer, grammar)
    row = mx.zeros((1, len(sm.tokenizer.get_vocab())))
    t0 = time.perf_counter()
    for tok in tokens:
        mx.eval(c.mask(row))
        c.advance(tok)
    return engine, 1e6 * (time.perf_counter() - t0) / len(tokens) - engine


def _outlines_mask_us(sm, tokens: list[int]) -> float | None:
    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        return None
    tok = sm.tokenizer
    eos = tok.eos_token_id
    pieces: dict[str, list[int]] = {}
    for i in range(len(tok.get_vocab())):
        if i != eos:
            pieces.setdefault(tok.decode([i]), []).append(i)
    guide = Guide(Index(build_regex_from_schema(json.dumps(MASK_SCHEMA)), Vocabulary(eos, pieces)))
    t0 = time.perf_counter()
    for t in tokens:
        guide.get_tokens()
        if t in guide.get_tokens():
            guide.advance(t)
    return 1e6 * (time.perf_counter() - t0) / len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root, home = Path(tmp) / "hub", Path(tmp) / "home"
        make_demo_model(root / REPO_ID)
        with HubServer(root) as server, hub_client.using_endpoint(server.url):
            pull(REPO_ID, home=home, progress=False)
            sm = open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="100%", prefetch=False))
            try:
                sm.tokenizer.eos_token_ids = set()  # the free run goes on to --tokens, as the grammar's does
                ids = sm.tokenizer.encode(PROMPT)
                runs: dict[str, list[float]] = {"free": [], "unpipelined": [], "grammar": []}
                for name in runs:  # warm: every expert into RAM, the grammar's tokenizer made
                    _decode_ms(sm, ids, args.tokens, name)
                for _ in range(args.rounds):
                    for name in runs:
                        runs[name].append(_decode_ms(sm, ids, args.tokens, name))
                # the grammar's own tokens: what its matcher follows in a real generation
                forced = SamplingSettings(
                    max_tokens=args.tokens, constraint=GrammarConstraint(sm.tokenizer, _grammar())
                )
                sample = [t.id for t in Generator(sm).generate(ids, forced)]
                masks: dict = {
                    "llguidance": _llguidance_mask_us(sm, sample),
                    "outlines-core": _outlines_mask_us(sm, sample),
                }
            finally:
                sm.close()
    medians = {k: statistics.median(v) for k, v in runs.items()}
    print(f"demo model, warm RAM, {args.tokens} tokens, {args.rounds} rounds (median decode ms per token)")
    for name, ms in medians.items():
        print(f"  {name:12s} {ms:8.2f} ms/token   rounds: {', '.join(f'{x:.2f}' for x in runs[name])}")
    ratio = medians["grammar"] / medians["free"]
    print(f"  grammar / free: {ratio:.3f}x (target <= 1.10)")
    print(f"  grammar / unpipelined: {medians['grammar'] / medians['unpipelined']:.3f}x (the mask's own share)")
    # on a shared machine the fastest round is the least disturbed one
    fastest = {k: min(v) for k, v in runs.items()}
    print(
        f"  fastest rounds: grammar / free {fastest['grammar'] / fastest['free']:.3f}x, "
        f"grammar / unpipelined {fastest['grammar'] / fastest['unpipelined']:.3f}x"
    )
    engine_us, apply_us = masks["llguidance"]
    print(f"  mask alone, llguidance: {engine_us:.1f} us/token, applying it in MLX {apply_us:.1f} us more")
    outlines = masks["outlines-core"]
    print("  mask alone, outlines-core: " + (f"{outlines:.1f} us/token" if outlines is not None else "not installed"))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians, "ratio": ratio, "masks": masks}, indent=2))


if __name__ == "__main__":
    main()
