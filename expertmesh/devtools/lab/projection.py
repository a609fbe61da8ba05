"""From the lab's measured per-expert costs to Kimi K3 on 1, 2 and 4 Macs: the arithmetic, in one place.

A decode token of K3 runs 92 MoE layers of 16 experts. With M Macs each holding 1/M of the
experts on its SSD (1.45 TB / M: 363 GB each for four, within a 500 GB disk), a layer's experts
split about evenly: 16/M run on the generating Mac, 16/M on each of the M - 1 others.

    service_s        one expert on the Mac that holds it: its bytes read from SSD (the share not
                     in RAM) + its compute
    here_s           (16/M) x service_s
    peer_s           call_s + nic_s + (16/M) x service_s      one call per peer, all in parallel
    nic_s            the activations of every remote expert through the generating Mac's own NIC,
                     (16 - 16/M) x activation_bytes / link: peers share it
    remote layer     max(here_s, peer_s)
    fetch layer      max(here_s, (16 - 16/M) x expert_bytes / link + (16 - 16/M) x compute_s)
    token            92 x layer + core_s

`call_s`, `activation_bytes` and the CPU `compute_s` are the lab's measurements; the SSD, the
RAM hit rate, the core's time per token and a Metal compute time are inputs, labelled as such.
The lab's compute runs on this machine's CPU, a stand-in for Metal: a projection "with CPU
compute" says what these cores would do, one "with Metal compute" uses the labelled input.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from expertmesh.node.constants import K3_EXPERT_BYTES, K3_MOE_LAYERS, K3_TOP_K

LINKS = {"1GbE": 118e6, "10GbE": 1.15e9}  # payload bytes/s
MACS = (1, 2, 4)
MOONSHOT_S = 1.5


@dataclass
class ProjectionInputs:
    """Measured (lab) and assumed (labelled) figures the projection uses."""

    # measured in the lab
    compute_s: float  # one expert's compute for one token row, on this machine's CPU
    call_s: float  # one ComputeExperts call's time outside the peer: round trip, (de)serialising
    activation_bytes: float  # bytes one remote expert use puts on the LAN, both directions
    ping_s: float | None = None  # an Info round trip: what call_s would be with the peers' cores idle
    # inputs: not measured here
    metal_compute_s: float = K3_EXPERT_BYTES / 400e9  # an expert read once from unified memory at 400 GB/s
    ssd_bytes_per_s: float = 5e9  # a Mac's internal SSD (DESIGN: 5-17 GB/s)
    ram_hit_rate: float = 0.0  # share of expert uses answered from RAM (0: every use read from SSD)
    core_s: float = 57e9 / 400e9  # the 8-bit core (57 GB) read once per token at 400 GB/s
    expert_bytes: int = K3_EXPERT_BYTES
    layers: int = K3_MOE_LAYERS
    top_k: int = K3_TOP_K

    def labels(self) -> dict[str, str]:
        return {
            "compute_s": "measured (lab, CPU: a stand-in for Metal)",
            "call_s": "measured (lab, shaped LAN; includes queueing on the shared 2 cores)",
            "ping_s": "measured (lab, Info round trip)",
            "activation_bytes": "measured (lab, K3's 3584-wide latent rows)",
            "metal_compute_s": "input (assumed: expert bytes / 400 GB/s)",
            "ssd_bytes_per_s": "input (assumed)",
            "ram_hit_rate": "input (assumed)",
            "core_s": "input (assumed: 57 GB 8-bit core / 400 GB/s)",
            "expert_bytes": "K3",
            "layers": "K3 MoE layers",
            "top_k": "K3",
        }


def layer_seconds(p: ProjectionInputs, macs: int, link: float, compute_s: float, remote: bool) -> float:
    """One MoE layer of one decode token on `macs` Macs over `link` bytes/s (see the module's table)."""
    here = p.top_k / macs
    away = p.top_k - here
    service = (1 - p.ram_hit_rate) * p.expert_bytes / p.ssd_bytes_per_s + compute_s
    here_s = here * service
    if macs == 1:
        return here_s
    if remote:
        nic_s = away * p.activation_bytes / link
        return max(here_s, p.call_s + nic_s + (p.top_k / macs) * service)
    return max(here_s, away * p.expert_bytes / link + away * compute_s)


def token_seconds(p: ProjectionInputs, macs: int, link: float, compute_s: float, remote: bool = True) -> float:
    return p.layers * layer_seconds(p, macs, link, compute_s, remote) + p.core_s


def project(p: ProjectionInputs) -> dict:
    """Projected s/token for K3 on 1, 2 and 4 Macs over each link, remote execution and fetching,
    with CPU (measured) and Metal (input) compute; and the inputs with their labels."""
    rows = []
    for compute_name, compute in (("cpu_measured", p.compute_s), ("metal_input", p.metal_compute_s)):
        for link_name, link in LINKS.items():
            for macs in MACS:
                rows.append(
                    {
                        "compute": compute_name,
                        "link": link_name,
                        "macs": macs,
                        "remote_s_per_token": token_seconds(p, macs, link, compute, True),
                        "fetch_s_per_token": token_seconds(p, macs, link, compute, False),
                    }
                )
    moon_s = token_seconds(p, 4, LINKS["1GbE"], p.metal_compute_s, True)  # the row of 4 Macs, Metal, 1GbE
    # the call time outside the peer that would just meet the moonshot, all else as given (< 0: out of reach)
    metal_rest = layer_seconds(
        ProjectionInputs(**{**asdict(p), "call_s": 0.0}), 4, LINKS["1GbE"], p.metal_compute_s, True
    )
    budget = (MOONSHOT_S - p.core_s) / p.layers - metal_rest
    return {
        "inputs": asdict(p),
        "labels": p.labels(),
        "rows": rows,
        "moonshot": {
            "target_s_per_token": MOONSHOT_S,
            "projected_s_per_token": moon_s,
            "met": moon_s <= MOONSHOT_S,
            "what": "K3, 4 Macs, 1 GbE, remote execution, Metal compute (input)",
            "call_s_budget": budget,
            "projected_with_ping_as_call_s_per_token": (
                token_seconds(
                    ProjectionInputs(**{**asdict(p), "call_s": p.ping_s}), 4, LINKS["1GbE"], p.metal_compute_s
                )
                if p.ping_s is not None
                else None
            ),
        },
    }


def format_projection(doc: dict) -> str:
    """The projection and its assumptions on one screen."""
    inputs, labels = doc["inputs"], doc["labels"]
    lines = ["K3 projection (92 MoE layers x 16 experts of 17.5 MB; each Mac holds 1/M of them on SSD)"]
    for k, v in inputs.items():
        if k.endswith("_per_s"):
            shown = f"{v / 1e9:.2f} GB/s"
        elif v is None:
            shown = "-"
        elif k.endswith("_s"):
            shown = f"{v * 1000:.3f} ms"
        else:
            shown = f"{v:,.3g}" if isinstance(v, float) else f"{v:,}"
        lines.append(f"  {k:<18} {shown:>14}   {labels.get(k, '')}")
    lines.append(f"  {'compute':<13} {'link':<6} {'Macs':>4} {'remote s/token':>15} {'fetch s/token':>14}")
    for r in doc["rows"]:
        lines.append(
            f"  {r['compute']:<13} {r['link']:<6} {r['macs']:>4} {r['remote_s_per_token']:>15.2f} "
            f"{r['fetch_s_per_token']:>14.2f}"
        )
    m = doc["moonshot"]
    verdict = "met" if m["met"] else "NOT met"
    lines.append(
        f"moonshot ({m['what']}): {m['projected_s_per_token']:.2f} s/token, target <= {m['target_s_per_token']} "
        f"s/token: {verdict}. CPU compute here stands in for Metal; the Metal figure is an input, not a measurement."
    )
    if m.get("projected_with_ping_as_call_s_per_token") is not None:
        lines.append(
            f"  with a call costing one Info round trip ({inputs['ping_s'] * 1000:.2f} ms) instead: "
            f"{m['projected_with_ping_as_call_s_per_token']:.2f} s/token"
        )
    budget = m["call_s_budget"]
    lines.append(
        f"  it is met with a call time outside the peer of at most {budget * 1000:.2f} ms (measured {inputs['call_s'] * 1000:.2f} ms)"
        if budget > 0
        else "  out of reach with these inputs whatever the network does: the SSD reads and the core alone exceed it"
    )
    return "\n".join(lines)
