"""`pull`: a model's core and expert index onto this machine (never its experts)."""

from __future__ import annotations

import argparse

from expertmesh.cli import arguments
from expertmesh.node import constants
from expertmesh.node.sizes import format_size


def add_commands(sub) -> None:
    p = sub.add_parser("pull", help="download a model's core and expert index (never its experts)")
    p.add_argument("repo", type=arguments.repo_id, help="Hugging Face repo id, e.g. moonshotai/Kimi-K3")
    p.add_argument("--revision", help="branch, tag or commit sha (default: main)")
    p.add_argument(
        "--concurrency",
        type=arguments.positive_int,
        default=constants.PULL_CONCURRENCY,
        help="range requests in flight to the Hub (default %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--index-only", action="store_true", help="only the expert index (for `serve --cache-only`)")
    p.add_argument(
        "--core-bits",
        type=int,
        choices=[16, 8, 4],
        metavar="{16,8,4}",
        help="8 or 4 stores and runs the core as MLX 8- or 4-bit weights (about a half or a quarter of the "
        "memory; experts keep their precision); default: 16 (BF16) for a new pull, else what is pulled",
    )
    p.add_argument(
        "--core-quant",
        metavar="RECIPE",
        help="quantise the core with mlx-lm's mixed recipe: mixed_4_6 (4 bits, 6 for the output head and "
        "the layers whose error grows most), mixed_3_6, mixed_3_4 or mixed_2_6",
    )
    p.set_defaults(func=pull)

    p = sub.add_parser(
        "verify",
        help="check the experts on disk against fresh copies from the Hub (replaces any a damaged first fetch left)",
    )
    p.add_argument("repo", type=arguments.repo_id, help="Hugging Face repo id of a pulled model")
    p.add_argument("--revision", help="branch, tag or commit sha (default: what is pulled)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=verify)


def verify(args: argparse.Namespace) -> int:
    """Each expert on disk whose digest came from one fetch is fetched again from the Hub
    (node/store/verify.py); exits 1 if any stayed undecided or could not be fetched."""
    from tqdm.auto import tqdm

    from expertmesh.assembly import build_node
    from expertmesh.node.config import NodeConfig
    from expertmesh.node.errors import ExpertmeshError
    from expertmesh.node.store.verify import unverified_on_disk, verify_experts

    node = build_node(NodeConfig(args.repo, revision=args.revision, cache_only=True)).start()
    try:
        disk, digests = node.disk, node.disk.digests
        if disk.refused:
            raise ExpertmeshError(
                f"the expert cache at {disk.root} cannot be written now (another expertmesh process keeps it, "
                "or its disk refuses writes): stop the other process and run verify again"
            )
        keys = unverified_on_disk(disk, digests)
        total = sum(node.index.expert(*k).nbytes for k in keys)
        with tqdm(total=total, unit="B", unit_scale=True, disable=args.no_progress, desc="verify") as bar:
            report = verify_experts(node.index, disk, node.hub, digests, keys, progress=bar.update)
    finally:
        node.close()
    already = len(disk.held()) - len(keys)
    print(
        f"{args.repo}: {len(keys)} experts checked against the Hub ({format_size(report.bytes_fetched)} fetched), "
        f"{report.confirmed} confirmed, {len(report.corrected)} corrected, {len(report.undecided)} undecided, "
        f"{len(report.failed)} not fetched; {already} were verified before"
    )
    for key in report.corrected:
        print(f"  corrected expert {key[1]} of layer {key[0]}: its first fetch was damaged")
    for key, error in report.failed[:5]:
        print(f"  expert {key[1]} of layer {key[0]}: {error}")
    return 1 if report.undecided or report.failed else 0


def pull(args: argparse.Namespace) -> int:
    from expertmesh.node.engine.core_quantization import pull_with_core_bits

    result = pull_with_core_bits(
        args.repo,
        revision=args.revision,
        progress=not args.no_progress,
        concurrency=args.concurrency,
        index_only=args.index_only,
        core_bits=args.core_bits,
        core_quant=args.core_quant,
    )
    print_pull(result)
    return 0


def print_pull(r) -> None:
    if r.already_complete:
        print(f"{r.repo_id} @ {r.commit[:12]} is already pulled: {r.path}")
        return
    if r.core_bytes == 0:  # --index-only
        print(
            f"pulled the expert index of {r.repo_id} @ {r.commit[:12]} ({r.model_type}) into {r.path}: "
            f"{r.expert_count} experts in {r.moe_layers} MoE layers; ready for `serve --cache-only`"
        )
        return
    rate = r.fetched_bytes / r.seconds if r.seconds > 0 else 0.0
    print(f"pulled {r.repo_id} @ {r.commit[:12]} ({r.model_type}) into {r.path}")
    bits = ""
    if r.core_bits != 16:
        bits = f" ({r.core_quant} weights)" if r.core_quant else f" ({r.core_bits}-bit weights)"
    print(
        f"  core     {format_size(r.core_bytes)}{bits}; fetched {format_size(r.fetched_bytes)} this run "
        f"in {r.seconds:.1f} s ({format_size(rate)}/s), {r.retries} retried requests"
    )
    print(
        f"  experts  {r.expert_count} in {r.moe_layers} MoE layers, {format_size(r.expert_bytes)} "
        "left on the Hub: fetched on demand"
    )
