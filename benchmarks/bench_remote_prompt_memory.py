"""What a household prompt's layer holds while its rows are out at the peers (issue 46).

engine/prefill.py's `_remote_layer` gathers each expert's rows from every chunk, hands them to the
household's remote execution and writes the outputs back into each chunk's output. This measures
MLX's peak over the prompt's inputs for that data movement alone, at K3's width (3,584, float32
as the bench's core), top-16 of 384 experts, in chunks of 2,048: the remote execution is a stand-in
that returns each expert's rows doubled (its compute is not what is measured), and a checksum of
the outputs shows two versions move the same numbers to the same places.

    python benchmarks/bench_remote_prompt_memory.py [--tokens 4096] [--prefill-module PATH]

`--prefill-module` measures another checkout's engine/prefill.py (an earlier commit's, for a
before/after pair).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import mlx.core as mx
import numpy as np

from expertmesh.node.constants import RPC_MAX_CALL_ROW_BYTES

WIDTH, TOP_K, EXPERTS, CHUNK = 3584, 16, 384, 2048


class _Household:
    """Stands in for RemoteExperts: each expert's rows doubled, evaluated as the peers' answers are,
    in parts of at most a call's rows (`run_into`, what engine/prefill.py calls now), or all at
    once (`run`, what an earlier checkout's prefill calls, for `--prefill-module`)."""

    def run(self, block, experts, rows, guess):
        out = {e: rows[e] * 2.0 for e in experts}
        mx.eval(list(out.values()))
        return out, {}

    def run_into(self, block, experts, rows, guess, outputs):
        per_call = max(1, RPC_MAX_CALL_ROW_BYTES // (WIDTH * 4))
        host = getattr(rows, "host", None)  # a peer's rows are read on the host since engine/expert_rows.py
        for e in experts:
            x = host(e) if host is not None else rows[e]
            for first in range(0, x.shape[0], per_call):
                part = mx.array(x[first : first + per_call]) * 2.0
                mx.eval(part)
                outputs.put(e, first, part)
            del x
        return {}


class _Block:
    _remote = _Household()
    output_dims = WIDTH


class _Chunk:
    def __init__(self, tokens: int, rng: np.random.Generator):
        self.x = mx.array(rng.standard_normal((1, tokens, WIDTH)).astype(np.float32))
        self.indices = mx.array(np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)])[None])


def _prefill_module(path: str | None):
    if path is None:
        from expertmesh.node.engine import prefill

        return prefill
    spec = importlib.util.spec_from_file_location("prefill_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["prefill_under_test"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--prefill-module", help="a path to engine/prefill.py (default: this install's)")
    args = ap.parse_args()
    prefill = _prefill_module(args.prefill_module)
    rng = np.random.default_rng(0)
    sizes = [CHUNK] * (args.tokens // CHUNK) + ([args.tokens % CHUNK] if args.tokens % CHUNK else [])
    parts = [_Chunk(n, rng) for n in sizes]
    mx.eval([p.x for p in parts] + [p.indices for p in parts])
    flats = [np.array(p.indices).reshape(-1) for p in parts]
    experts = np.unique(np.concatenate(flats)).tolist()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    ys, _ = prefill._remote_layer(_Block(), parts, flats, experts, None)
    mx.eval(ys)
    peak = mx.get_peak_memory() - base
    checksum = float(sum(mx.sum(y * mx.arange(y.shape[0])[:, None]).item() for y in ys))
    print(
        f"{args.prefill_module or 'this install'}: {args.tokens} tokens, MLX peak over the inputs {peak / 1e9:.3f} GB, "
        f"outputs {sum(y.nbytes for y in ys) / 1e9:.3f} GB, checksum {checksum:.6e}"
    )


if __name__ == "__main__":
    main()
