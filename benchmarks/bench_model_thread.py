"""How long this node's tokens and peers' ComputeExperts calls wait for each other on the one MLX
thread (node/engine/model_thread.py), side by side in one run (issue 24).

One node with the K3-proportioned small model (1.6 MB mxfp4 experts, 3 MoE layers, top-8 of 32),
every expert it uses in RAM after a warm-up, so only the MLX thread is contended. Peers are
emulated by threads calling the node's real ComputeExperts path (`ExpertComputer.compute`, as
the gRPC service does) back to back, each call one token's worth of a layer (8 experts, 1 row
each), for as long as the local generation runs:

    generation alone     this node generates; nobody else uses the MLX thread
    peer calls alone     the peer threads flood the node; no local generation
    both                 the generation and the flood at once

Columns: a local token's time as the consumer sees it; the local token's wait (its queueing on the
MLX thread plus the peer calls it let run inside it); a peer call's wait (hand-over to start); and
how many peer calls ran inside one local token. The fair order bounds the two waits: a peer waits
about one MoE layer's compute, not a generation; a token waits for at most one peer call per MoE
layer plus one, however many peers are queued.

    python benchmarks/bench_model_thread.py [--tokens 24] [--peers 2,8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from expertmesh.assembly import build_node
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import k3_proportions
from expertmesh.node.config import NodeConfig, StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.household.expert_compute import ExpertComputer
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull
from expertmesh.v1 import node_pb2

REPO_ID = "expertmesh/k3-small"
PROMPT = "the household computes the experts it holds and sends back their rows"


def _ms(values: list[float]) -> tuple[float, float]:
    return (1e3 * statistics.median(values), 1e3 * max(values)) if values else (float("nan"), float("nan"))


def _requests(sm, rng: np.random.Generator) -> list[node_pb2.ComputeExpertsRequest]:
    """One request per MoE layer: 8 of the experts the warm-up left in RAM, one float32 row each."""
    out = []
    for block in sm.blocks:
        held = sorted(e for (layer, e) in sm.store.ram.keys() if layer == block.layer)[:8]
        rows = [
            node_pb2.ExpertRows(
                expert=e,
                rows=node_pb2.Tensor(
                    shape=[1, block.input_width],
                    dtype="float32",
                    data=rng.standard_normal((1, block.input_width)).astype(np.float32).tobytes(),
                ),
            )
            for e in held
        ]
        out.append(node_pb2.ComputeExpertsRequest(model=node_pb2.ModelKey(), layer=block.layer, experts=rows))
    return out


class _Flood:
    """Peer threads calling ComputeExperts back to back until stopped."""

    def __init__(self, computer: ExpertComputer, requests: list, threads: int):
        self.stop = threading.Event()
        self.calls = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(computer, requests, i)) for i in range(threads)]

    def _run(self, computer: ExpertComputer, requests: list, i: int) -> None:
        n = i
        while not self.stop.is_set():
            result = computer.compute(requests[n % len(requests)])
            assert not result.missing
            n += 1
            with self._lock:
                self.calls += 1

    def __enter__(self) -> _Flood:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join()


def _generate(sm, ids: list[int], tokens: int) -> list[float]:
    """Seconds between tokens after the first; the MLX thread's waits are counted from the first
    token on (the prompt's prefill, a few long layers, is not what a decoding token waits for)."""
    times = []
    for _ in Generator(sm).generate(ids, SamplingSettings(max_tokens=tokens)):
        if not times:
            model_thread().waits.clear()
        times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def run(tokens: int, peers: list[int], seconds_alone: float) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="bench-model-thread-"))
    try:
        hub_dir, home = work / "hub", work / "home"
        k3_proportions.build_small(hub_dir / REPO_ID)
        with HubServer(hub_dir) as hub, hub_client.using_endpoint(hub.url):
            pull(REPO_ID, home=home, progress=False)
            store = StoreConfig(ram_budget="100%", disk_budget="100%", prefetch=False, fill=False)
            node = build_node(NodeConfig(REPO_ID, home=home, store=store)).start()
            try:
                return _measure(node.model, tokens, peers, seconds_alone)
            finally:
                node.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _measure(sm, tokens: int, peers: list[int], seconds_alone: float) -> list[dict]:
    mlx = model_thread()
    ids = sm.tokenizer.encode(PROMPT)
    _generate(sm, ids, tokens)  # warm-up: every expert these tokens use is now in RAM
    requests = _requests(sm, np.random.default_rng(0))
    computer = ExpertComputer(sm)
    for r in requests:
        computer.compute(r)  # and the peer calls' kernels are compiled
    rows = [_row("generation alone", _generate(sm, ids, tokens), mlx, 0)]
    for n in peers:
        mlx.waits.clear()
        with _Flood(computer, requests, n) as flood:
            time.sleep(seconds_alone)
        rows.append(_row(f"{n} peers alone", [], mlx, flood.calls))
        with _Flood(computer, requests, n) as flood:
            gaps = _generate(sm, ids, tokens)
        rows.append(_row(f"both, {n} peers", gaps, mlx, flood.calls))
    return rows


def _row(name: str, gaps: list[float], mlx, calls: int) -> dict:
    waits = mlx.waits
    turns = list(waits.peer_turns_in_local)
    return {
        "name": name,
        "token_ms": _ms(gaps),
        "token_wait_ms": _ms(list(waits.local)) if gaps else (float("nan"), float("nan")),
        "peer_wait_ms": _ms(list(waits.peer)),
        "peer_calls": calls,
        "peer_calls_per_token": (statistics.median(turns), max(turns)) if gaps and turns else (0, 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--peers", default="2,8", help="peer threads calling ComputeExperts back to back (a list)")
    ap.add_argument("--seconds-alone", type=float, default=3.0, help="how long the peers flood alone")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    peers = [int(n) for n in args.peers.split(",")]
    rows = run(args.tokens, peers, args.seconds_alone)
    p = k3_proportions.SMALL
    print(
        f"\n{REPO_ID}: {p.moe_layers} MoE layers, top-{p.top_k} of {p.experts} experts of {p.expert_bytes / 1e6:.1f} MB; "
        f"{args.tokens} tokens; peers are threads calling ComputeExperts back to back; p50 / max in ms, "
        "waits from the first token on\n"
    )
    print(
        f"{'':<18} {'local token':>16} {'token waits':>16} {'peer call waits':>18} {'peer calls':>11} {'inside a token':>15}"
    )
    for r in rows:
        t, w, pw = r["token_ms"], r["token_wait_ms"], r["peer_wait_ms"]
        inside = r["peer_calls_per_token"]
        print(
            f"{r['name']:<18} {t[0]:>7.1f} / {t[1]:>6.1f} {w[0]:>7.1f} / {w[1]:>6.1f} {pw[0]:>9.1f} / {pw[1]:>6.1f} "
            f"{r['peer_calls']:>11} {inside[0]:>7} / {inside[1]:>5}"
        )
    alone = rows[0]["token_ms"][0]
    print(
        f"\none MoE layer of a token alone ≈ {alone / p.moe_layers:.1f} ms ({alone:.1f} ms over {p.moe_layers} MoE "
        f"layers): inside a token one peer call runs per MoE layer, and one more between tokens. A peer call "
        "queued during the prompt's prefill waits for a prefill layer instead (the max column)."
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
