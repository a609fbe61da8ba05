"""`expertmesh status`: the household's headline numbers in a terminal, for people without Grafana.

Every node found is asked for Info; the table shows each node's role, model, cache fill and
throughput, then each node's requests to the Hub in the Hub's current rate-limit window, and the
household's expert uses by source — the share served from RAM and disk is the household's hit
rate, the Hub's share what still crosses the internet.
"""

from __future__ import annotations

from collections import Counter

from expertmesh.node.rpc.client import NodeAnswer
from expertmesh.node.sizes import format_size
from expertmesh.node.store.stats import SOURCES


def shown(text: str, limit: int = 40) -> str:
    """A peer's word (its id, role, model name, a bucket's name) as a terminal line may carry it:
    control characters, which could move the cursor, rewrite earlier lines or set the window's
    title, become `?`, and it is cut to `limit` characters. Members hold the secret, but what
    they say is still theirs to choose."""
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


def _fill(used: int, budget: int) -> str:
    return f"{format_size(used)} / {format_size(budget)}" if budget else "-"


def _hub_request_lines(nodes: list[NodeAnswer]) -> list[str]:
    """Each node's requests to the Hub in the Hub's current rate-limit window, by bucket, against
    the quota the Hub announced: `resolvers` is what expert fetches spend (node/hub/rate_limit.py)."""
    lines = []
    for n in nodes:
        if n.info is None or not any(n.info.hub_requests.values()):
            continue
        quota = dict(n.info.hub_quota)
        counts = ", ".join(
            f"{shown(bucket, 16)} {count:,}" + (f" of {quota[bucket]:,}" if bucket in quota else "")
            for bucket, count in sorted(n.info.hub_requests.items())
        )
        lines.append(f"{shown(n.info.node_id)}: Hub requests this rate-limit window: {counts}")
    return lines


def status_lines(nodes: list[NodeAnswer]) -> list[str]:
    lines = [
        f"{'node':<18} {'address':<22} {'role':<6} {'model':<34} {'RAM used / budget':>20} "
        f"{'disk used / budget':>22} {'peers':>5} {'tokens':>7} {'tokens/s':>8}"
    ]
    uses: Counter = Counter()
    nbytes: Counter = Counter()
    for n in nodes:
        i = n.info
        if i is None:
            lines.append(f"{'?':<18} {n.address:<22} {'?':<6} ({n.error})")
            continue
        model = ", ".join(f"{shown(m.repo_id, 96)}@{shown(m.commit[:8])}" for m in i.models[:4])
        rate = f"{i.generated_tokens / i.generation_seconds:.2f}" if i.generation_seconds > 0 else "-"
        lines.append(
            f"{shown(i.node_id):<18} {n.address:<22} {shown(i.role, 8):<6} {model:<34} {_fill(i.ram_used_bytes, i.ram_budget_bytes):>20} "
            f"{_fill(i.disk_used_bytes, i.disk_budget_bytes):>22} {i.live_peers:>5} {i.generated_tokens:>7} {rate:>8}"
        )
        uses.update(dict(i.expert_uses))
        nbytes.update(dict(i.expert_bytes))
    lines += _hub_request_lines(nodes)
    total = sum(uses.values())
    if total:
        shares = ", ".join(f"{s} {100 * uses[s] / total:.1f}%" for s in SOURCES)
        lines.append(f"expert uses by source: {shares} of {total}; {format_size(nbytes['hub'])} came from the Hub")
    elif nodes:
        lines.append("no expert has been used yet")
    else:
        lines.append("no nodes found (is multicast blocked? try --peer HOST:PORT)")
    return lines
