"""One `gather_qmm` per MoE layer against one `quantized_matmul` per expert, side by side in one run.

A batch of rows routes to the union of their experts. expertmesh computes each expert on its own rows
with `quantized_matmul` (node/engine/blocks.py); mlx-lm's SwitchGLU stacks every expert of the layer
and runs one `gather_qmm`. A streaming node holds experts as separate arrays, so a gather means
stacking the union's weights first (counted here). For each shape this prints both timings, their
ratio, and whether the outputs are bit-identical.

    python benchmarks/bench_gather_qmm.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

# (experts in the union, rows per expert, in, out, mode, group size)
SHAPES = (
    (4, 1, 32, 64, "affine", 32),  # tiny kimi_k3, one row's 4 experts
    (11, 1, 32, 64, "affine", 32),  # tiny kimi_k3, four rows' union
    (11, 2, 32, 64, "affine", 32),
    (11, 1, 64, 32, "mxfp4", 32),
    (11, 1, 384, 768, "affine", 64),  # the wide random K3
    (16, 1, 1024, 1024, "mxfp4", 32),  # K3 proportions, SMALL variant
)


def _experts(n: int, rows: int, d_in: int, d_out: int, mode: str, group: int):
    weights = [mx.quantize(mx.random.normal((d_out, d_in)), group_size=group, bits=4, mode=mode) for _ in range(n)]
    xs = [mx.random.normal((rows, d_in)) for _ in range(n)]
    mx.eval(weights, xs)
    return weights, xs


def per_expert(weights, xs, mode: str, group: int) -> mx.array:
    outs = []
    for q, x in zip(weights, xs):
        w, scales, *biases = q
        b = biases[0] if biases else None
        outs.append(mx.quantized_matmul(x, w, scales, b, transpose=True, group_size=group, bits=4, mode=mode))
    return mx.concatenate(outs)


def gathered(weights, xs, mode: str, group: int) -> mx.array:
    w = mx.stack([q[0] for q in weights])
    scales = mx.stack([q[1] for q in weights])
    biases = mx.stack([q[2] for q in weights]) if len(weights[0]) > 2 else None
    rows = [x.shape[0] for x in xs]
    index = mx.array(np.repeat(np.arange(len(xs)), rows).astype(np.uint32))
    y = mx.gather_qmm(
        mx.concatenate(xs)[:, None, :],
        w,
        scales,
        biases,
        rhs_indices=index,
        transpose=True,
        group_size=group,
        bits=4,
        mode=mode,
        sorted_indices=True,
    )
    return y.squeeze(1)


def _time(fn, repeats: int, *args) -> float:
    for _ in range(3):  # the first call of a shape compiles
        mx.eval(fn(*args))
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn(*args))
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    mx.random.seed(0)
    print(
        f"{'experts':>7} {'rows':>4} {'shape':>11} {'mode':>6} {'per expert ms':>13} {'gather ms':>9} {'ratio':>6} identical"
    )
    for n, rows, d_in, d_out, mode, group in SHAPES:
        weights, xs = _experts(n, rows, d_in, d_out, mode, group)
        a, b = per_expert(weights, xs, mode, group), gathered(weights, xs, mode, group)
        same = bool(mx.array_equal(a, b).item())
        t_per = _time(per_expert, args.repeats, weights, xs, mode, group)
        t_gather = _time(gathered, args.repeats, weights, xs, mode, group)
        print(
            f"{n:>7} {rows:>4} {f'{d_in}->{d_out}':>11} {mode:>6} {t_per * 1e3:>13.3f} {t_gather * 1e3:>9.3f} "
            f"{t_gather / t_per:>5.2f}x {same}"
        )


if __name__ == "__main__":
    main()
