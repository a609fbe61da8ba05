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

from expertmesh.node.constants import (
    K3_EXPERT_BYTES,
    K3_EXPERTS_PER_LAYER,
    K3_MOE_LAYERS,
    K3_TOP_K,
    RPC_MAX_CALL_ROW_BYTES,
)

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


def _input_lines(inputs: dict, labels: dict[str, str]) -> list[str]:
    """Each input, in its unit, beside where it comes from (measured, or an input and whose)."""
    lines = []
    for k, v in inputs.items():
        if v is None:
            shown = "-"
        elif k.endswith("_per_s"):
            shown = f"{v / 1e9:.2f} GB/s"
        elif k.endswith("_s"):
            shown = f"{v * 1000:,.3f} ms"
        else:
            shown = f"{v:,.4g}" if isinstance(v, float) else f"{v:,}"
        lines.append(f"  {k:<18} {shown:>14}   {labels.get(k, '')}")
    return lines


def format_projection(doc: dict) -> str:
    """The projection and its assumptions on one screen."""
    inputs, labels = doc["inputs"], doc["labels"]
    lines = ["K3 projection (92 MoE layers x 16 experts of 17.5 MB; each Mac holds 1/M of them on SSD)"]
    lines += _input_lines(inputs, labels)
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


# -- a prompt ---------------------------------------------------------------------------------
#
# A prompt of T tokens needs a layer's union U of experts (engine/prompt_cost.py's even-router
# model: U = E (1 - (1 - k/E)^T)), each with R = T k / U of its rows. Fetched from their owners,
# the (M - 1)/M of U that other Macs hold cross the generating Mac's NIC as expert bytes; computed
# where they are, only those experts' rows cross it (T k (M - 1)/M rows, in and out). Either way
# the Macs read their own share from SSD and compute it.
#
#     expert_s      metal_expert_s + R x metal_row_s     one expert over its R rows (CPU: R x cpu_row_s)
#     service_s     (1 - ram_hit_rate) x expert_bytes / ssd + expert_s
#     here_s        (U/M) x service_s
#     fetch layer   max(here_s, U (M-1)/M x (expert_bytes / link + expert_s))
#     remote layer  max(here_s, calls x call_s + T k (M-1)/M x row_bytes / link + (U/M) x service_s)
#     TTFT          92 x layer + core_s                   the core read once; its compute not counted

K3_EXPERT_FLOPS_PER_ROW = 2 * 3 * 3584 * 3072  # w1, w3, w2 of 3584 x 3072: a multiply and an add per weight
# gather_qmm on Apple Silicon at 80 rows per expert (mlx-serve #366, quoted by issue 46): the few
# rows per expert of a short prompt run at about this rate, far below the 10.2 TFLOP/s of 1,280
METAL_FEW_ROWS_FLOPS = 0.79e12


@dataclass
class PromptInputs:
    """Measured (the lab's prompt scenarios) and assumed figures for a prompt's projection."""

    tokens: int
    # measured in the lab
    row_bytes: float  # LAN bytes per row sent to one expert and its output back (prompt_remote)
    call_s: float  # one ComputeExperts call's time outside the peer (prompt_remote's links)
    cpu_row_s: float  # one row through one expert on this CPU, core included (prompt_fetch_from_owners)
    # inputs: not measured here
    metal_row_s: float = K3_EXPERT_FLOPS_PER_ROW / METAL_FEW_ROWS_FLOPS
    metal_expert_s: float = K3_EXPERT_BYTES / 400e9  # the expert's weights read once from unified memory
    ssd_bytes_per_s: float = 5e9
    ram_hit_rate: float = 0.0
    core_s: float = 57e9 / 400e9
    max_call_bytes: int = RPC_MAX_CALL_ROW_BYTES  # a call's rows; CALLS_IN_FLIGHT_PER_PEER of them at once
    expert_bytes: int = K3_EXPERT_BYTES
    experts: int = K3_EXPERTS_PER_LAYER
    layers: int = K3_MOE_LAYERS
    top_k: int = K3_TOP_K
    lab_lan_bytes_per_s: float | None = None  # the NIC call_s was measured through

    def labels(self) -> dict[str, str]:
        # A call's time outside the peer includes its rows' transfer through the lab's NIC, which
        # the layer's sum counts again on the projected link: a lab LAN slower than that link
        # makes the remote figure err slow (docs/benchmarks.md, the lab at 12 MB/s).
        lan = self.lab_lan_bytes_per_s
        through = f" through a {lan / 1e6:g} MB/s NIC, its rows' transfer included" if lan else ""
        return {
            "tokens": "the prompt",
            "row_bytes": "measured (lab prompt_remote: LAN activation bytes / its remote row-uses)",
            "call_s": f"measured (lab prompt_remote{through}; includes queueing on the shared 2 cores)",
            "cpu_row_s": "measured (lab prompt_fetch_from_owners: TTFT less its waits / row-uses)",
            "metal_row_s": "input (66 MFLOP a row at gather_qmm's 0.79 TFLOP/s, mlx-serve #366)",
            "metal_expert_s": "input (expert bytes / 400 GB/s)",
            "ssd_bytes_per_s": "input (assumed)",
            "ram_hit_rate": "input (assumed)",
            "core_s": "input (57 GB 8-bit core read once / 400 GB/s; its compute not counted)",
            "max_call_bytes": "expertmesh's default",
            "expert_bytes": "K3",
            "experts": "K3 experts per MoE layer",
            "layers": "K3 MoE layers",
            "top_k": "K3",
            "lab_lan_bytes_per_s": "the lab's --lan (where call_s was measured)",
        }


def prompt_layer_seconds(p: PromptInputs, macs: int, link: float, metal: bool, remote: bool) -> float:
    """One MoE layer of the prompt on `macs` Macs over `link` bytes/s (see the table above)."""
    from expertmesh.node.prompt_cost import expected_union

    union = expected_union(p.experts, p.top_k, p.tokens)
    rows = p.tokens * p.top_k / union
    expert_s = (p.metal_expert_s + rows * p.metal_row_s) if metal else rows * p.cpu_row_s
    service = (1 - p.ram_hit_rate) * p.expert_bytes / p.ssd_bytes_per_s + expert_s
    here_s = union / macs * service
    if macs == 1:
        return here_s
    away = (macs - 1) / macs
    if not remote:
        return max(here_s, union * away * (p.expert_bytes / link + expert_s))
    from expertmesh.node.household.remote_experts import CALLS_IN_FLIGHT_PER_PEER

    peer_rows_bytes = p.tokens * p.top_k / macs * p.row_bytes / 2  # the rows one way, to one peer
    calls = max(1, -(-int(peer_rows_bytes) // p.max_call_bytes))
    rounds = -(-calls // CALLS_IN_FLIGHT_PER_PEER)
    nic_s = p.tokens * p.top_k * away * p.row_bytes / link
    return max(here_s, rounds * p.call_s + nic_s + union / macs * service)


def project_prompt(p: PromptInputs) -> dict:
    """Projected time to a K3 prompt's first token on 1, 2 and 4 Macs over each link, its experts
    computed where they are and fetched from their owners, with CPU (measured) and Metal (input)
    compute; the issue-46 target (>= 5x sooner on 4 Macs) read off the 4-Mac, 1 GbE, Metal row."""
    rows = []
    for compute in ("cpu_measured", "metal_input"):
        metal = compute == "metal_input"
        for link_name, link in LINKS.items():
            for macs in MACS:
                remote_s, fetch_s = (
                    p.layers * prompt_layer_seconds(p, macs, link, metal, r) + p.core_s for r in (True, False)
                )
                rows.append(
                    {
                        "compute": compute,
                        "link": link_name,
                        "macs": macs,
                        "remote_ttft_s": remote_s,
                        "fetch_ttft_s": fetch_s,
                        "sooner": fetch_s / remote_s,
                    }
                )
    target = next(r for r in rows if r["compute"] == "metal_input" and r["link"] == "1GbE" and r["macs"] == 4)
    return {
        "inputs": asdict(p),
        "labels": p.labels(),
        "rows": rows,
        "target": {"sooner": 5.0, "projected": target["sooner"], "what": "K3, 4 Macs, 1 GbE, Metal compute (input)"},
    }


def format_prompt_projection(doc: dict) -> str:
    """The prompt's projection and its assumptions on one screen."""
    inputs, labels = doc["inputs"], doc["labels"]
    lines = [f"K3 prompt projection: {inputs['tokens']} tokens, each Mac holding 1/M of the experts on SSD"]
    lines += _input_lines(inputs, labels)
    lines.append(f"  {'compute':<13} {'link':<6} {'Macs':>4} {'remote TTFT s':>14} {'fetch TTFT s':>13} {'sooner':>7}")
    for r in doc["rows"]:
        lines.append(
            f"  {r['compute']:<13} {r['link']:<6} {r['macs']:>4} {r['remote_ttft_s']:>14.1f} "
            f"{r['fetch_ttft_s']:>13.1f} {r['sooner']:>6.1f}x"
        )
    t = doc["target"]
    lines.append(
        f"prompt target ({t['what']}): projected {t['projected']:.1f}x sooner, target >= {t['sooner']:.0f}x. "
        "A projection from the lab's bytes and calls, not a measurement: the Metal figures are inputs."
    )
    return "\n".join(lines)
