"""One scenario of the lab, in a process of its own: the generating Mac's node, measured.

Run by the lab driver (inside node 0's namespace when namespaces are up) as
`python -m expertmesh.devtools.lab.worker SPEC_JSON`; prints one JSON line. The node is
built by the same composition root as `expertmesh run`: alone (the Hub only), or with the
household's nodes — found with zeroconf across the bridge when `spec["cluster"]` is set, else the
addresses in `spec["peers"]` — fetching their experts (`remote` false) or sending them
activations (`remote` true). Each call to the placement is tallied, so the lab shows where each
expert use ran and what the cost model estimated when it chose.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from expertmesh.assembly import Node
    from expertmesh.node.engine.streamed_model import StreamedModel

JOIN_WAIT_S = 60.0  # at most this long between prompts for a joining node to be seen (not in decode time)


def _hub_bytes(url: str) -> int:
    with urllib.request.urlopen(f"{url}/_hub/stats", timeout=30) as r:
        return int(json.load(r)["bytes_served"])


def _discover(cluster: str, interface: str, want: int, wait_s: float) -> list[str]:
    """Addresses of the nodes of `cluster` that zeroconf finds on `interface` (up to `want`, within `wait_s`)."""
    from expertmesh.node.household.lookup import browse
    from expertmesh.node.household.membership import PeerTable

    table = PeerTable(self_id="expertmesh-lab", self_weight=0.0)
    browse(table, cluster, interface, wait_s, enough=want)
    return sorted(p.address for p in table.all())


class _Tally:
    """Wraps RemoteExperts.plan: per node id, the experts placed there, and the last estimates."""

    def __init__(self, remote) -> None:
        self.placed: Counter = Counter()
        self.estimates: list[dict[str, float]] = []
        plan = remote.plan

        def counted(layer, experts, row_bytes):
            placement = plan(layer, experts, row_bytes)
            for peer in placement.remote.values():
                self.placed[peer.node_id] += 1
            self.placed["here"] += len(experts) - len(placement.remote)
            if len(self.estimates) < 200:
                self.estimates.append({k: round(v, 6) for k, v in placement.estimate_s.items()})
            return placement

        remote.plan = counted


def _full(node: Node) -> StreamedModel:
    """The node's model: a lab worker is always a full node."""
    if node.model is None:
        raise RuntimeError("a lab worker's node has no model (a cache peer?)")
    return node.model


def _generate(sm: StreamedModel, ids: list[int], tokens: int, on_token=None) -> dict:
    from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings

    summary = GenerationSummary()
    out, before, t_first = [], None, None
    t_start, at_start = time.perf_counter(), sm.store.stats.snapshot()
    for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=tokens), summary=summary):
        out.append(t.id)
        if before is None:  # decode is measured after the first token
            before, t_first = sm.store.stats.snapshot(), time.perf_counter()
        if on_token is not None:
            on_token(len(out))
    decode_s = time.perf_counter() - t_first if t_first else 0.0
    d = sm.store.stats.since(before) if before is not None else sm.store.stats.snapshot()
    ttft_s = t_first - t_start if t_first else 0.0
    p = before.since(at_start) if before is not None else None  # the prompt's, up to its first token
    prompt = {"uses": dict(p.uses), "remote": dict(p.remote), "wait_s": p.wait_seconds} if p is not None else {}
    return {
        "ids": out,
        "decode_s": decode_s,
        "decode_tokens": max(0, len(out) - 1),
        "stats": d,
        "ttft_s": ttft_s,
        "prompt": prompt,
    }


def _long_prompt(sm: StreamedModel, prompts: list[str], n: int) -> list[int]:
    """`n` token ids: the lab's prompts' tokens over and over (the same ids in every scenario)."""
    ids = [t for p in prompts for t in sm.tokenizer.encode(p)]
    return (ids * (n // max(1, len(ids)) + 1))[:n]


def _nodes_uses(node: Node) -> dict[str, dict[str, int]]:
    """Each household node's own expert uses by source since it started (its Info), by node id:
    taken before and after the measured prompts, they show where the nodes got what they were
    asked to compute or send (an owner that lacks an expert fetches it from its peers or the Hub)."""
    import grpc

    source = node.peer_tier
    if source is None:
        return {}
    uses = {}
    for p in source.table.all():
        try:
            uses[p.node_id] = dict(source.client(p.address).info(timeout=5.0).expert_uses)
        except grpc.RpcError:
            continue  # a node killed by the scenario
    return uses


def _links(node: Node) -> dict[str, dict]:
    """What the node has learnt of each peer it sends calls to (household/remote_experts.py's
    `LinkEstimate`): the figures its placements and deadlines are made from."""
    if node.remote is None:
        return {}
    return {
        nid: {
            "rtt_s": k.rtt_s,
            "call_s": k.call_s,
            "service_s": k.service_s,
            "bandwidth": k.bandwidth,
            "prompt_scale": k.prompt_scale,
            "misses": k.misses,
        }
        for nid, k in node.remote.links.items()
    }


def _warm_up_record(warm: dict, node: Node) -> dict:
    """The untimed warm-up's own calls and what they taught: measured prompts without a missed
    deadline may owe it to the warm-up's misses (`prompt_scale`), which their figures cannot show."""
    return {
        "ttft_s": warm["ttft_s"],
        "prompt_remote": warm["prompt"].get("remote", {}),
        "decode_remote": dict(warm["stats"].remote),
        "links": _links(node),
        # what checking the peers' first copies fetched from the Hub: it is done in the warm-up
        "audit_bytes": node.stats.audit_bytes,
        # each compute peer's first answer computed again here (household/compute_audit.py)
        "compute_audits": dict(node.stats.compute_audits),
    }


def run(spec: dict) -> dict:
    from expertmesh.assembly import build_node
    from expertmesh.node.config import HouseholdConfig, NodeConfig, RemoteConfig, RpcConfig, StoreConfig
    from expertmesh.node.hub import client as hub_client

    home = Path(spec["home"])
    peers: list[str] = list(spec.get("peers", []))
    found_by = "static"
    if spec.get("cluster"):
        peers = _discover(spec["cluster"], spec["interface"], spec["expect_peers"], spec.get("discovery_wait_s", 10))
        found_by = "zeroconf"
    store = StoreConfig(**spec["store"])
    household, rpc = None, None
    if spec["mode"] != "alone":
        remote = RemoteConfig(lan_bandwidth=spec.get("lan_bandwidth", 118e6)) if spec["mode"] == "remote" else None
        household = HouseholdConfig(secret=spec["secret"], peers=peers, remote=remote)
        if spec.get("live_discovery"):  # as `serve` does: advertise (owning nothing: no disk) and follow the others
            household = HouseholdConfig(
                secret=spec["secret"],
                discover=True,
                cluster=spec["cluster"],
                interface=spec["interface"],
                remote=remote,
            )
            rpc = RpcConfig(host=spec["interface"], port=0)
            found_by = "zeroconf (live)"
    out: dict = {"peers": peers, "found_by": found_by}
    with hub_client.using_endpoint(spec["hub_url"]):
        if spec.get("warm_first"):  # untimed: the prompts' experts onto this node's disk
            node = build_node(NodeConfig(spec["repo_id"], home=home, store=store, household=household)).start()
            sm = _full(node)
            for prompt in spec["prompts"]:
                _generate(sm, sm.tokenizer.encode(prompt), spec["tokens"])
            sm.store.disk.flush()
            node.close()
        node = build_node(NodeConfig(spec["repo_id"], home=home, store=store, household=household, rpc=rpc)).start()
        try:
            table = node.peers
            if rpc is not None and table is not None:  # wait (bounded) until zeroconf has found the nodes that are up
                deadline = time.monotonic() + spec.get("discovery_wait_s", 10)
                while len(table.all()) < spec["expect_peers"] and time.monotonic() < deadline:
                    time.sleep(0.2)
                out["peers"] = sorted(p.address for p in table.all())
            sm = _full(node)
            tally = _Tally(node.remote) if node.remote is not None else None
            warm = _generate(sm, sm.tokenizer.encode(spec["warm_up"]), 3)  # connections, kernels, first estimates
            out["warm_up"] = _warm_up_record(warm, node)
            kill = spec.get("kill")

            join = spec.get("join")

            def on_token(n: int) -> None:
                if kill and n == kill["after_token"] and not out.get("killed"):
                    os.kill(kill["pid"], signal.SIGKILL)
                    out["killed"] = {"pid": kill["pid"], "after_token": n}
                if join and n == join["after_token"] and not out.get("join_asked"):
                    out["join_asked"] = {"after_token": n, "peers": len(table.all()) if table is not None else 0}
                    print("JOIN", flush=True)  # the lab starts the node now

            if tally is not None:  # what the measured prompts placed, not the warm-up's
                tally.placed.clear()
                tally.estimates.clear()
            hub0, audit0 = _hub_bytes(spec["hub_url"]), node.stats.audit_bytes
            nodes0 = _nodes_uses(node)
            runs = []
            measured = [sm.tokenizer.encode(p) for p in spec["prompts"]]
            if spec.get("prompt_tokens"):
                measured = [_long_prompt(sm, spec["prompts"], spec["prompt_tokens"])]
            for i, ids in enumerate(measured):
                if i == 1 and out.get("join_asked"):  # the next prompt with the joined node, once zeroconf shows it
                    t0, before = time.monotonic(), out["join_asked"]["peers"]
                    while table is not None and len(table.all()) <= before and time.monotonic() - t0 < JOIN_WAIT_S:
                        time.sleep(0.2)
                    out["join_seen_after_s"] = round(time.monotonic() - t0, 2)
                runs.append(_generate(sm, ids, spec["tokens"], on_token if i == 0 else None))
            hub_bytes = _hub_bytes(spec["hub_url"]) - hub0
            out["audit_bytes"] = node.stats.audit_bytes - audit0  # its part of hub_bytes
            out["compute_audits"] = dict(
                node.stats.compute_audits
            )  # since the node started: warm-up's first answers too
            out["peer_errors"] = dict(table.errors) if table is not None else {}  # e.g. an owner's fetch "stalled"
            nodes1 = _nodes_uses(node)
            out["nodes_uses"] = {  # during the measured prompts, by node and source
                nid: {k: v - nodes0[nid].get(k, 0) for k, v in after.items() if v - nodes0[nid].get(k, 0)}
                for nid, after in nodes1.items()
                if nid in nodes0
            }
            out["peers_at_end"] = len(table.all()) if table is not None else 0
            out["links"] = _links(node)  # {} without remote execution
        finally:
            node.close()
    tokens = sum(r["decode_tokens"] for r in runs)
    sources = list(runs[0]["stats"].uses)
    uses = {k: sum(r["stats"].uses[k] for r in runs) for k in sources}
    nbytes = {k: sum(r["stats"].bytes[k] for r in runs) for k in sources}
    remote_counts = {k: sum(r["stats"].remote[k] for r in runs) for k in runs[0]["stats"].remote}
    decode_s = sum(r["decode_s"] for r in runs)
    wait_s = sum(r["stats"].wait_seconds for r in runs)
    out.update(
        outputs=[r["ids"] for r in runs],
        tokens=tokens,
        decode_s=decode_s,
        s_per_token=decode_s / max(1, tokens),
        uses=uses,
        bytes=nbytes,
        remote=remote_counts,
        # by the Hub during the prompts: prefill, guesses, decode and this node's audits of peers' copies
        hub_served_bytes=hub_bytes,
        wait_s=wait_s,
        ttft_s=[r["ttft_s"] for r in runs],
        prompt_stats=[r["prompt"] for r in runs],
        prompt_tokens=len(measured[0]),
        placed=dict(tally.placed) if tally else {"here": sum(uses.values())},
        estimates=tally.estimates[-4:] if tally else [],
    )
    return out


if __name__ == "__main__":
    result = run(json.loads(sys.argv[1]))
    print(json.dumps(result))
