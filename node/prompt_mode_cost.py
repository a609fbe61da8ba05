"""What a prompt of N tokens costs in each `--prompt-experts` mode, before its first token.

Built on node/prompt_cost.py's expected union (an even router's: an upper bound), with a share
`disk_share` of every layer's experts already on this Mac's disk (a quarter of K3's on a 350 GB
disk), each expert read once:

- exact: the union's missing part over the link, its held part from the disk;
- held: nothing over the link while anything is held (each row's missing choices go to held
  experts), the held experts the rows then use from the disk: at most the union, at most the
  held share of the layer;
- budget:S: what S seconds of the link carry of exact's missing part, the rest as held.

drop and topp:P depend on the router's weights and are measured, not planned
(`expertmesh bench --prompt-experts`); keep moves held's bytes (none over the link) and computes
fewer expert uses, which this plan, of bytes only, does not count.
"""

from __future__ import annotations

from dataclasses import dataclass

from expertmesh.node.prompt_cost import PromptCost


@dataclass
class ModeCost:
    mode: str
    link_bytes: float
    disk_bytes: float
    link_bytes_per_s: float
    disk_bytes_per_s: float

    @property
    def seconds(self) -> float:
        return self.link_bytes / self.link_bytes_per_s + self.disk_bytes / self.disk_bytes_per_s

    def as_json(self) -> dict:
        return {
            "mode": self.mode,
            "link_bytes": self.link_bytes,
            "disk_bytes": self.disk_bytes,
            "seconds": self.seconds,
        }


def mode_costs(cost: PromptCost, disk_share: float, budget_s: float) -> list[ModeCost]:
    """exact, held and budget:`budget_s` for `cost`'s prompt with `disk_share` of the experts on disk."""
    share = min(1.0, max(0.0, disk_share))
    union = cost.union_bytes
    missing, on_disk = union * (1 - share), union * share
    held_read = min(union, share * cost.experts * cost.moe_layers * cost.expert_bytes)
    rates = (cost.link_bytes_per_s, cost.disk_bytes_per_s)
    out = [ModeCost("exact", missing, on_disk, *rates)]
    if share <= 0:  # nothing held: held and budget fetch what exact fetches
        out += [ModeCost("held", missing, 0.0, *rates), ModeCost(f"budget:{budget_s:g}", missing, 0.0, *rates)]
        return out
    out.append(ModeCost("held", 0.0, held_read, *rates))
    fetched = min(missing, budget_s * cost.link_bytes_per_s)
    out.append(ModeCost(f"budget:{budget_s:g}", fetched, max(on_disk, held_read), *rates))
    return out


def lines(costs: list[ModeCost], disk_share: float) -> list[str]:
    from expertmesh.node.sizes import format_size

    exact = costs[0].seconds
    out = [
        f"  by --prompt-experts, with {disk_share:.0%} of the experts on disk (drop, topp and keep are measured, not planned):"
    ]
    for c in costs:
        ratio = f" ({c.seconds / exact:.2f}x exact)" if exact > 0 else ""
        out.append(
            f"    {c.mode}: {format_size(c.link_bytes)} over the link, {format_size(c.disk_bytes)} from disk, "
            f"about {c.seconds:.0f} s{ratio}"
        )
    return out
