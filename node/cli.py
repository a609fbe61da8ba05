"""The `expertmesh` command line. It parses arguments and calls library functions; errors
meant for the user become one line on stderr and a non-zero exit code, never a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from node import constants
from node.errors import ExpertmeshError
from node.sizes import format_size

DEMO_REPO = "expertmesh/tiny-kimi-k3"


def _cmd_pull(args: argparse.Namespace) -> int:
    from node.pull import pull

    result = pull(args.repo, revision=args.revision, progress=not args.no_progress, concurrency=args.concurrency)
    _print_pull(result)
    return 0


def _print_pull(r) -> None:
    if r.already_complete:
        print(f"{r.repo_id} @ {r.commit[:12]} is already pulled: {r.path}")
        return
    rate = r.fetched_bytes / r.seconds if r.seconds > 0 else 0.0
    print(f"pulled {r.repo_id} @ {r.commit[:12]} ({r.model_type}) into {r.path}")
    print(f"  core     {format_size(r.core_bytes)}; fetched {format_size(r.fetched_bytes)} this run "
          f"in {r.seconds:.1f} s ({format_size(rate)}/s), {r.retries} retried requests")  # fmt: skip
    print(f"  experts  {r.expert_count} in {r.moe_layers} MoE layers, {format_size(r.expert_bytes)} "
          "left on the Hub: fetched on demand")  # fmt: skip


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from node.tiny import make_tiny_model

    out = make_tiny_model(Path(args.out), args.arch, args.seed)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote tiny {args.arch} (seed {args.seed}) to {out}: {format_size(size)}")
    return 0


def _cmd_hub(args: argparse.Namespace) -> int:
    from node.hub_server import knobs_from_args, serve_forever_cli

    serve_forever_cli(Path(args.dir), args.host, args.port, knobs_from_args(args))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Make (or reuse) the demo model, serve it from a local Hub inside this process, pull it."""
    from node import hub_client
    from node.hub_server import HubServer
    from node.pull import pull
    from node.tiny import make_tiny_model

    hub_dir = constants.expertmesh_home() / "demo" / "hub"
    repo_dir = hub_dir / DEMO_REPO
    if not (repo_dir / "config.json").is_file():
        print(f"making the demo model {DEMO_REPO} in {repo_dir}")
        make_tiny_model(repo_dir, "kimi_k3", seed=0)
    with HubServer(hub_dir, host="127.0.0.1", port=0) as hub:
        print(f"serving it with a local Hub at {hub.url}")
        with hub_client.using_endpoint(hub.url):
            result = pull(DEMO_REPO, progress=not args.no_progress)
        _print_pull(result)
        stats = hub.stats()
    served = stats.get("bytes_served", 0)
    print(f"  the Hub served {format_size(served)} in {stats.get('requests', 0)} requests "
          f"(core {format_size(result.fetched_bytes)}, the rest headers, config and tokenizer)")  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertmesh",
        description="Run trillion-parameter Mixture-of-Experts models on the Macs of a household.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (retries, fetches)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("pull", help="download a model's core and expert index (never its experts)")
    p.add_argument("repo", help="Hugging Face repo id, e.g. moonshotai/Kimi-K3")
    p.add_argument("--revision", help="branch, tag or commit sha (default: main)")
    p.add_argument("--concurrency", type=int, default=constants.PULL_CONCURRENCY, help="range requests in flight")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_pull)

    p = sub.add_parser("tiny-model", help="write a tiny MoE repo in an upstream layout (tests, demos)")
    p.add_argument("out", help="folder to write the repo into (replaced)")
    p.add_argument("--arch", required=True, choices=["kimi_k3", "deepseek_v3", "qwen3_moe", "mlx_qwen3_moe"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_tiny_model)

    p = sub.add_parser("hub", help="serve a folder of model repos over the Hugging Face Hub protocol")
    p.add_argument("dir", help="folder holding NAMESPACE/NAME/ repo folders")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    from node.hub_server import add_knob_arguments

    add_knob_arguments(p)
    p.set_defaults(func=_cmd_hub)

    p = sub.add_parser("demo", help="the whole path on a built-in tiny model, no internet needed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # huggingface_hub's bars for small files would interleave with ours
    try:
        return args.func(args)
    except ExpertmeshError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted: what was fetched is kept; run the same command again to resume", file=sys.stderr)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(130)  # do not wait for in-flight downloads; their parts are published atomically


if __name__ == "__main__":
    sys.exit(main())
