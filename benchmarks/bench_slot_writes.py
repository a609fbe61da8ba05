"""How an arriving expert gets into a RAM-tier slot (node/store/tiers/ram.py), side by side in one run.

The RAM tier keeps a pool's experts in one stack per projection array, so mlx-lm's `gather_qmm`
reads them as it reads a layer's stacked weights. An arriving expert must get into its slot
without copying the stack. Ways measured, at Kimi K3's expert size (17,547,264 bytes: mxfp4 w1,
w3 of 3072 x 3584 and w2 of 3584 x 3072, group 32) by default:

    donated      `mx.slice_update` of each stack, nothing else referencing it: MLX gives the old
                 stack's buffer to the result and copies one slot (what the RAM tier does)
    referenced   the same while something still references the old stack (a lazy graph that
                 reads it): MLX copies the whole stack, then the slot
    view         numpy writing through the stack's buffer (memoryview), as a fetch worker could:
                 no MLX op, but nothing stops it from writing a slot a pending kernel still reads
    restack      `mx.stack` of a layer's k experts for every token (what the slots avoid)

For each: milliseconds per expert, bytes MLX allocated beyond the stacks (peak), and how often a
write moved the stack to another buffer (a copy of all of it).

    python benchmarks/bench_slot_writes.py [--slots 32] [--k 16] [--repeats 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

K3 = {"w1": (3072, 3584), "w3": (3072, 3584), "w2": (3584, 3072)}  # (out, in) of each projection
GROUP = 32


def _expert(scale: int = 1) -> dict[str, tuple[mx.array, mx.array]]:
    """One mxfp4 expert as the codec decodes it: packed uint32 weights, uint8 scales."""
    out = {}
    for name, (rows, cols) in K3.items():
        rows, cols = rows // scale, cols // scale
        w = mx.array(np.random.default_rng(0).integers(0, 2**32, (rows, cols // 8), dtype=np.uint32))
        s = mx.array(np.full((rows, cols // GROUP), 120, dtype=np.uint8))
        out[name] = (w, s)
    mx.eval(out)
    return out


def _stacks(expert, slots: int) -> dict[str, list[mx.array]]:
    stacks = {name: [mx.zeros((slots, *a.shape), a.dtype) for a in arrays] for name, arrays in expert.items()}
    mx.eval(stacks)
    return stacks


def _where(a: mx.array) -> int:
    view = memoryview(a)
    try:
        return np.asarray(view).ctypes.data
    finally:
        view.release()


def _write(stacks, expert, slot: int) -> None:
    at = mx.array([slot])
    for name, arrays in stacks.items():
        for i, stack in enumerate(arrays):
            arrays[i] = mx.slice_update(stack, expert[name][i][None], at, (0,))


def donated(stacks, expert, slot: int, _held: list) -> None:
    _write(stacks, expert, slot)
    mx.eval(stacks)


def referenced(stacks, expert, slot: int, held: list) -> None:
    held.append({n: list(a) for n, a in stacks.items()})  # a graph still reading the old stacks
    _write(stacks, expert, slot)
    mx.eval(stacks)
    held.clear()


def view(stacks, expert, slot: int, _held: list) -> None:
    for name, arrays in stacks.items():
        for stack, part in zip(arrays, expert[name]):
            target = memoryview(stack)
            try:
                np.asarray(target)[slot] = np.asarray(part)
            finally:
                target.release()


def _measure(way, stacks, expert, repeats: int, slots: int) -> dict:
    held: list = []
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    seconds, moved = 0.0, 0
    for n in range(repeats):
        before = _where(stacks["w1"][0])
        t0 = time.perf_counter()
        way(stacks, expert, n % slots, held)
        mx.synchronize()
        seconds += time.perf_counter() - t0
        moved += _where(stacks["w1"][0]) != before
    return {
        "ms_per_expert": seconds * 1e3 / repeats,
        "peak_extra_bytes": max(0, mx.get_peak_memory() - base),
        "stack_moved": f"{moved} of {repeats}",
    }


def _restack(experts: list, repeats: int) -> dict:
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval([mx.stack([e[name][i] for e in experts]) for name in K3 for i in range(2)])
    seconds = (time.perf_counter() - t0) / repeats
    return {
        "ms_per_expert": seconds * 1e3 / len(experts),
        "peak_extra_bytes": max(0, mx.get_peak_memory() - base) // len(experts),
        "stack_moved": "a new stack each time",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=32, help="slots per stack (default %(default)s)")
    ap.add_argument("--k", type=int, default=16, help="experts a layer re-stacks per token (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--scale", type=int, default=1, help="divide K3's widths by this (default %(default)s)")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    expert = _expert(args.scale)
    expert_bytes = sum(a.nbytes for arrays in expert.values() for a in arrays)
    stacks = _stacks(expert, args.slots)
    results = {}
    for name, way in (("donated", donated), ("referenced", referenced), ("view", view)):
        results[name] = _measure(way, stacks, expert, args.repeats, args.slots)
    results["restack"] = _restack([expert] * args.k, max(1, args.repeats // 4))
    print(f"expert {expert_bytes:,} bytes, stacks of {args.slots} slots ({args.slots * expert_bytes / 1e9:.2f} GB)")
    print(f"{'way':<11}{'ms / expert':>12}{'extra bytes (peak)':>20}{'x expert':>10}  stack moved")
    for name, r in results.items():
        extra = r["peak_extra_bytes"]
        print(f"{name:<11}{r['ms_per_expert']:>12.2f}{extra:>20,}{extra / expert_bytes:>10.2f}  {r['stack_moved']}")
    if args.json:
        doc = {"expert_bytes": expert_bytes, "slots": args.slots, "k": args.k, "results": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
