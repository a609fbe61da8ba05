"""Decode built ahead (node/engine/generation.py `_plain`) against the same code stepping serially,
and mlx-lm beside both, on the `expertmesh bench --compute` shapes with every expert resident.

Three runs per round, taken in turns so the machine's load falls on all of them alike:

    ahead    the next token's pass built and started before this token is read (the default)
    serial   the same node with building ahead turned off: build a pass, wait for it, read it
    mlx_lm   `mlx_lm.stream_generate` on the same repo, which builds ahead as well

Per decode token: wall, process CPU and the MLX thread's own CPU (the host's Python building
graphs) seconds, the median over the rounds, and ahead ÷ serial. On a CPU the device's compute
shares the cores with the host, so there is little to hide; on Metal the host's graph building
is what building ahead hides behind the GPU (docs/macos.md step 6).

    python benchmarks/bench_decode_ahead.py [--shapes qwen3_depth,demo] [--tokens 48] [--rounds 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from expertmesh.devtools import bench_compute

RUNS = ("ahead", "serial", "mlx_lm")


def measure(shape: str, tokens: int, rounds: int) -> dict:
    """Seconds per decode token of each run on `shape`, the median over `rounds` taken in turns."""
    from expertmesh.node.engine.generation import Generator

    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-ahead-") as tmp:
        with (
            bench_compute.served(shape, Path(tmp)) as (repo_id, repo_dir, home),
            bench_compute.resident(repo_id, repo_dir, home) as (sm, ref, tokenizer, ids),
        ):
            builds_ahead = Generator._builds_ahead

            def serial(tick: Callable[[], None]) -> list[int]:
                Generator._builds_ahead = lambda self: False  # type: ignore[method-assign]
                try:
                    return bench_compute._ours(sm, ids, tokens, tick)
                finally:
                    Generator._builds_ahead = builds_ahead  # type: ignore[method-assign]

            times = bench_compute._timed(
                {
                    "ahead": lambda tick: bench_compute._ours(sm, ids, tokens, tick),
                    "serial": serial,
                    "mlx_lm": lambda tick: bench_compute._run_on_mlx_thread(
                        bench_compute._mlx_lm, ref, tokenizer, ids, tokens, tick
                    ),
                },
                rounds,
            )
    entry: dict = {"shape": shape, "tokens": tokens, "rounds": rounds}
    for name in RUNS:
        for key in ("wall", "cpu", "host"):
            entry[f"{name}_{key}_s_per_token"] = round(times[name][f"{key}_s"], 5)
    entry["wall_ahead_over_serial"] = round(entry["ahead_wall_s_per_token"] / entry["serial_wall_s_per_token"], 3)
    entry["wall_ahead_over_mlx_lm"] = round(entry["ahead_wall_s_per_token"] / entry["mlx_lm_wall_s_per_token"], 3)
    entry["tokens_equal"] = times["ahead"]["tokens"] == times["serial"]["tokens"] == times["mlx_lm"]["tokens"]
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3_depth,demo", help="of " + ",".join(bench_compute.SHAPES))
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for shape in args.shapes.split(","):
        entry = measure(shape, args.tokens, args.rounds)
        results.append(entry)
        print(f"{shape}: tokens equal {entry['tokens_equal']}")
        print(f"  {'ms / decode token':<20}{'ahead':>10}{'serial':>10}{'mlx-lm':>10}")
        for key in ("wall", "cpu", "host"):
            cells = "".join(f"{entry[f'{run}_{key}_s_per_token'] * 1e3:>10.2f}" for run in RUNS)
            print(f"  {key:<20}{cells}")
        print(
            f"  wall ahead / serial {entry['wall_ahead_over_serial']:.3f}, "
            f"ahead / mlx-lm {entry['wall_ahead_over_mlx_lm']:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
