"""`run`, `chat` and `demo`: generating on one node, the text on stdout, a summary on stderr."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from expertmesh.cli import arguments
from expertmesh.cli.models import print_pull
from expertmesh.node import constants
from expertmesh.node.config import RUN_METRICS_LINGER_S, MetricsConfig, NodeConfig
from expertmesh.node.sizes import format_size

if TYPE_CHECKING:
    from expertmesh.assembly import Node
    from expertmesh.node.observability.metrics import MetricsServer


def add_commands(sub) -> None:
    p = sub.add_parser("run", help="generate text from a prompt on a pulled model")
    p.add_argument("repo", type=arguments.repo_id, help="Hugging Face repo id of a pulled model")
    p.add_argument("prompt", help="the prompt (raw text, no chat template)")
    arguments.add_store_arguments(p)
    arguments.add_memory_arguments(p)
    arguments.add_peer_arguments(p)
    arguments.add_discovery_arguments(p)
    arguments.add_sampling_arguments(p)
    arguments.add_prompt_experts_argument(p)
    arguments.add_speculation_arguments(p)
    arguments.add_metrics_arguments(p, default=None)
    p.add_argument(
        "--metrics-linger",
        type=arguments.seconds,
        default=RUN_METRICS_LINGER_S,
        metavar="S",
        help="after generating, keep /metrics up until it is scraped once more, at most S seconds, so "
        "Prometheus sees the final counts (default %(default)s; 0: stop at once)",
    )
    p.set_defaults(func=run)

    p = sub.add_parser("chat", help="chat with a pulled model (its chat template, multi-turn)")
    p.add_argument("repo", type=arguments.repo_id, help="Hugging Face repo id of a pulled model")
    p.add_argument("--system", help="system prompt")
    arguments.add_store_arguments(p)
    arguments.add_memory_arguments(p)
    arguments.add_peer_arguments(p)
    arguments.add_discovery_arguments(p)
    arguments.add_sampling_arguments(p, max_tokens=512)
    arguments.add_prompt_experts_argument(p)
    arguments.add_speculation_arguments(p)
    p.set_defaults(func=chat)

    p = sub.add_parser("demo", help="the whole path on a built-in tiny model, no internet needed")
    p.add_argument("--prompt", default="Return the number of", help="what to generate from (default %(default)r)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    arguments.add_store_arguments(p)
    # a tiny model loops when greedy; seeded, it stays repeatable
    arguments.add_sampling_arguments(p, max_tokens=48, temp=0.5, seed=0)
    arguments.add_speculation_arguments(p, default="off", draft_default=f"the demo's own, {constants.DEMO_DRAFT_REPO}")
    p.set_defaults(func=demo)


def node_config(args: argparse.Namespace, metrics: bool = False) -> NodeConfig:
    """`run`'s and `chat`'s flags as the node they describe."""
    metrics_config = None
    if metrics and getattr(args, "metrics_port", None) is not None:
        metrics_config = MetricsConfig(
            host=args.metrics_host or "127.0.0.1",
            port=args.metrics_port,
            linger_s=max(0.0, getattr(args, "metrics_linger", 0.0)),
        )
    return NodeConfig(
        args.repo,
        revision=args.revision,
        store=arguments.store_config(args),
        household=arguments.generating_household(args),
        metrics=metrics_config,
        max_context=args.max_context,
        core_budget=args.core_budget,
        prefix_cache=args.prefix_cache,
        prefix_disk_budget=args.prefix_disk_budget,
    )


def _generate_once(node: Node, prompt: str, args: argparse.Namespace) -> None:
    from expertmesh.cli.terminal import PrefillLine, StopFlag, ctrl_c_stops, print_summary, stream_text
    from expertmesh.node.engine.generation import GenerationSummary, Generator

    sm = node.require_model()
    tokens = sm.tokenizer.encode(as_text(prompt))
    summary = GenerationSummary()
    with ctrl_c_stops(StopFlag()) as flag:
        generator = Generator(sm, arguments.speculation(args))
        generator.prefill_progress = PrefillLine()  # a cold prompt can fetch for minutes: say where it is
        stream_text(generator.generate(tokens, arguments.sampling(args), flag, summary), summary)
    print_summary(summary)


def run(args: argparse.Namespace) -> int:
    from expertmesh.assembly import build_node

    arguments.speculation(args)  # a bad --speculate/--draft fails before the model loads
    config = node_config(args, metrics=True)
    with build_node(config) as node:
        _mark_used(node)
        print(node.describe(), file=sys.stderr)
        print_plan(node)
        if node.metrics_server is not None:
            print(f"metrics on {node.metrics_server.url}", file=sys.stderr)
        try:
            _generate_once(node, args.prompt, args)
        finally:  # a failed generation's counts are worth a scrape too
            if node.metrics_server is not None and config.metrics is not None:
                _linger(node.metrics_server, config.metrics.linger_s)
    return 0


def print_plan(node: Node) -> None:
    """The node's memory plan in one line and, for a streamed core, the changes that would hold it
    whole (node/doctor.py's `plan_model`), on stderr."""
    from expertmesh.node.doctor import plan_model

    plan = node.memory
    if plan is None:
        return
    print(f"memory on this machine: {plan.parts()}", file=sys.stderr)
    if not plan.streamed:
        return
    config = node.config
    if config.core_budget is not None:
        print("  the core is read from the SSD every token, within --core-budget", file=sys.stderr)
        return
    planned = plan_model(
        config.home or constants.expertmesh_home(),
        config.repo_id,
        revision=node.commit,
        max_context=config.max_context,
        ram_budget=config.store.ram_budget,
    )
    changes = planned.planner.changes()
    print(
        "  the core is read from the SSD every token"
        + (f"; to hold it whole: {', or '.join(changes)}" if changes else ": no fewer bits would hold it whole here"),
        file=sys.stderr,
    )


def _linger(server: MetricsServer, seconds: float) -> None:
    """Keep `/metrics` up until one more scrape, at most `seconds` (MetricsServer.linger says why)."""
    if seconds <= 0:
        return

    def announce() -> None:
        print(
            f"keeping {server.url} up until it is scraped, at most {seconds:g} s (--metrics-linger; Ctrl-C ends it)",
            file=sys.stderr,
            flush=True,
        )

    try:
        scraped = server.linger(seconds, announce)
    except KeyboardInterrupt:
        return
    if not scraped:
        print(f"/metrics was not scraped within {seconds:g} s; stopping it", file=sys.stderr)


def chat(args: argparse.Namespace) -> int:
    from expertmesh.assembly import build_node
    from expertmesh.cli.terminal import chat_loop
    from expertmesh.node.engine.chat import ChatSession
    from expertmesh.node.engine.generation import Generator

    speculation = arguments.speculation(args)
    with build_node(node_config(args)) as node:
        _mark_used(node)
        print(node.describe(), file=sys.stderr)
        print("type a message; Ctrl-C stops a reply, Ctrl-D or /exit ends the chat", file=sys.stderr)
        from expertmesh.cli.terminal import PrefillLine

        generator = Generator(node.require_model(), speculation)
        generator.prefill_progress = PrefillLine()  # a cold prompt can fetch for minutes: say where it is
        session = ChatSession(generator, system_prompt=args.system)
        settings = arguments.sampling(args)
        chat_loop(lambda text, stop, summary: session.reply(text, settings, stop, summary), read_line=read_line)
    return 0


def read_line(prompt: str) -> str:
    """`input`, but with the prompt on stderr when stdout is not a terminal: `chat ... > reply.txt`
    then keeps only the replies, and the person typing still sees where to type."""
    if sys.stdin is None:  # started with stdin closed (`0<&-`, some launchers): nothing to read
        raise EOFError
    if sys.stdout.isatty():
        return as_text(input(prompt))
    print(prompt, end="", file=sys.stderr, flush=True)
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return as_text(line.rstrip("\n"))


def as_text(text: str) -> str:
    """`text` as valid Unicode: bytes that were not UTF-8 (Python keeps them as lone surrogates
    when it decodes stdin or argv) become U+FFFD, which the tokenizer takes, instead of an error."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _mark_used(node: Node) -> None:
    """Stamp the revision as used now, for `expertmesh ls`."""
    from expertmesh.node.hub import local_models

    home = node.config.home or constants.expertmesh_home()
    local_models.mark_used(local_models.model_dir(home, node.repo_id, node.commit))


def demo(args: argparse.Namespace) -> int:
    """Make (or reuse) the demo model, serve it from a local Hub inside this process, pull it and
    generate with experts fetched from that Hub on demand."""
    from expertmesh.assembly import build_node
    from expertmesh.devtools.local_hub import HubServer
    from expertmesh.devtools.tiny.demo_model import make_demo_model, make_draft_model
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    hub_dir = constants.expertmesh_home() / "demo" / "hub"
    repo_dir = hub_dir / constants.DEMO_REPO
    if not (repo_dir / "config.json").is_file():
        print(
            f"making the demo model {constants.DEMO_REPO} (a tiny Kimi K3 trained on Python's docstrings) in {repo_dir}"
        )
        make_demo_model(repo_dir)
    draft_dir = hub_dir / constants.DEMO_DRAFT_REPO  # its draft model, for --speculate draft here and with `run`
    if not (draft_dir / "config.json").is_file():
        make_draft_model(draft_dir)
    if args.draft is None:
        args.draft = str(draft_dir)  # the folder: no second download from the Hub it serves
    with HubServer(hub_dir, host="127.0.0.1", port=0) as hub, hub_client.using_endpoint(hub.url):
        print(f"1. serving it with a local Hub at {hub.url}")
        print("2. pulling the core (never the experts)")
        result = pull(constants.DEMO_REPO, progress=not args.no_progress)
        print_pull(result)
        pulled = hub.stats()
        print(
            f"   the Hub served {format_size(pulled.get('bytes_served', 0))} in {pulled.get('requests', 0)} "
            f"requests (core {format_size(result.fetched_bytes)}, the rest headers, config and tokenizer)"
        )
        config = NodeConfig(constants.DEMO_REPO, store=arguments.store_config(args))
        with build_node(config) as node:
            _mark_used(node)
            print(f"3. generating: {node.describe()}")
            print(f"   prompt: {args.prompt!r}")
            sys.stdout.flush()
            _generate_once(node, args.prompt, args)
        served = hub.stats().get("bytes_served", 0) - pulled.get("bytes_served", 0)
    if served:
        print(
            f"   the Hub served {format_size(served)} of experts during generation; run `expertmesh demo` "
            "again and they come from the disk cache"
        )
    else:
        print("   the Hub served no experts: every one came from this machine's caches")
    return 0
