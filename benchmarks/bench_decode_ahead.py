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
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from expertmesh.devtools import bench_compute

RUNS = ("ahead", "serial", "mlx_lm")


def measure(shape: str, tokens: int, rounds: int) -> dict:
    """Seconds per decode token of each run on `shape`, the median over `rounds` taken in turns."""
    import mlx_lm

    from expertmesh.assembly import open_model
    from expertmesh.devtools.local_hub import HubServer
    from expertmesh.node.config import StoreConfig
    from expertmesh.node.engine.generation import Generator
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-ahead-") as tmp:
        hub_dir, home = Path(tmp) / "hub", Path(tmp) / "home"
        repo_id = bench_compute._make(shape, hub_dir)
        with HubServer(hub_dir) as hub, hub_client.using_endpoint(hub.url):
            pull(repo_id, home=home, progress=False)
            ref, tokenizer = bench_compute._run_on_mlx_thread(mlx_lm.load, str(hub_dir / repo_id))
            ids = tokenizer.encode(bench_compute.PROMPT)
            store = StoreConfig(ram_budget=bench_compute.RAM_ALL, prefetch=False, fill=False)
            sm = open_model(repo_id, home=home, store=store)
            try:
                if sm.codec.dense_dtype is not None:  # as bench --compute: mlx-lm in the dtype we run
                    bench_compute._run_on_mlx_thread(ref.set_dtype, sm.codec.dense_dtype)
                bench_compute._warm_ram(sm)
                if not sm.all_resident():
                    raise SystemExit(f"{shape}: the RAM tier did not take every expert")
                builds_ahead = Generator._builds_ahead

                def serial(tick: Callable[[], None]) -> list[int]:
                    Generator._builds_ahead = lambda self: False  # type: ignore[method-assign]
                    try:
                        return bench_compute._ours(sm, ids, tokens, tick)
                    finally:
                        Generator._builds_ahead = builds_ahead  # type: ignore[method-assign]

                runs: dict[str, Callable[[Callable[[], None]], list[int]]] = {
                    "ahead": lambda tick: bench_compute._ours(sm, ids, tokens, tick),
                    "serial": serial,
                    "mlx_lm": lambda tick: bench_compute._run_on_mlx_thread(
                        bench_compute._mlx_lm, ref, tokenizer, ids, tokens, tick
                    ),
                }
                seen: dict[str, dict[str, list[float]]] = {r: {"wall": [], "cpu": [], "host": []} for r in RUNS}
                outputs: dict[str, list[int]] = {}
                for _ in range(rounds):
                    for name in RUNS:
                        ticks = bench_compute._Tokens(dict)
                        outputs[name] = runs[name](ticks.tick)
                        for key, values in seen[name].items():
                            values.append(ticks.per_token(key))
            finally:
                sm.close()
    entry: dict = {"shape": shape, "tokens": tokens, "rounds": rounds}
    for name in RUNS:
        for key, values in seen[name].items():
            entry[f"{name}_{key}_s_per_token"] = round(statistics.median(values), 5)
    entry["wall_ahead_over_serial"] = round(entry["ahead_wall_s_per_token"] / entry["serial_wall_s_per_token"], 3)
    entry["wall_ahead_over_mlx_lm"] = round(entry["ahead_wall_s_per_token"] / entry["mlx_lm_wall_s_per_token"], 3)
    entry["tokens_equal"] = outputs["ahead"] == outputs["serial"] == outputs["mlx_lm"]
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
