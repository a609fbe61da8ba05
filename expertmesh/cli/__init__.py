"""The `expertmesh` command line. It parses arguments and calls library functions; errors
meant for the user become one line on stderr and a non-zero exit code, never a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from expertmesh.node import constants
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.sizes import format_size
from expertmesh.node.store.policies import DEFAULT_POLICY, POLICIES

DEMO_REPO = constants.DEMO_REPO
DEMO_DRAFT_REPO = constants.DEMO_DRAFT_REPO


def _cmd_pull(args: argparse.Namespace) -> int:
    from expertmesh.node.hub.pull import pull

    result = pull(
        args.repo,
        revision=args.revision,
        progress=not args.no_progress,
        concurrency=args.concurrency,
        index_only=args.index_only,
        core_bits=args.core_bits,
    )
    _print_pull(result)
    return 0


def _print_pull(r) -> None:
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
    bits = "" if getattr(r, "core_bits", 16) == 16 else f" ({r.core_bits}-bit weights)"
    print(
        f"  core     {format_size(r.core_bytes)}{bits}; fetched {format_size(r.fetched_bytes)} this run "
        f"in {r.seconds:.1f} s ({format_size(rate)}/s), {r.retries} retried requests"
    )
    print(
        f"  experts  {r.expert_count} in {r.moe_layers} MoE layers, {format_size(r.expert_bytes)} "
        "left on the Hub: fetched on demand"
    )


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from expertmesh.node.devtools.tiny import make_tiny_model

    out = make_tiny_model(Path(args.out), args.arch, args.seed)
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote tiny {args.arch} (seed {args.seed}) to {out}: {format_size(size)}")
    return 0


def _cmd_hub(args: argparse.Namespace) -> int:
    from expertmesh.node.devtools.local_hub import knobs_from_args, serve_forever_cli

    serve_forever_cli(Path(args.dir), args.host, args.port, knobs_from_args(args))
    return 0


def _store_config(args: argparse.Namespace):
    from expertmesh.node.engine.streamed_model import StoreConfig

    return StoreConfig(
        ram_budget=args.ram_budget,
        disk_budget=args.disk_budget,
        ram_policy=args.ram_policy,
        trace_path=Path(args.trace) if args.trace else None,
        prefetch=not args.no_prefetch,
        fill=not args.no_fill,
        hub_connections=args.hub_connections,
    )


def _sampling(args: argparse.Namespace):
    from expertmesh.node.engine.generation import SamplingSettings

    return SamplingSettings(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, seed=args.seed)


def _speculation(args: argparse.Namespace):
    """--speculate/--draft as a SpeculationConfig (None: off). Raises SpeculationError on a bad pair."""
    from expertmesh.node.engine.speculative import SpeculationConfig

    mode = getattr(args, "speculate", "off")
    return None if mode == "off" else SpeculationConfig(mode=mode, draft_repo=getattr(args, "draft", None))


def _secret(args: argparse.Namespace) -> tuple[str, bool]:
    """The household secret: --secret, EXPERTMESH_SECRET, else the one kept in the home (created if none)."""
    from expertmesh.node.rpc.auth import load_or_create_secret

    secret = getattr(args, "secret", None) or constants.household_secret()
    if secret:
        return secret, False
    return load_or_create_secret(constants.expertmesh_home() / constants.SECRET_FILENAME)


def _tls_ca(args: argparse.Namespace) -> bytes | None:
    """The household CA for calls to other nodes: --tls-ca, $EXPERTMESH_TLS_CA, or a serving node's own cert."""
    from expertmesh.node.rpc.tls import load_ca

    return load_ca(getattr(args, "tls_ca", None) or getattr(args, "tls_cert", None))


def _open_model(args: argparse.Namespace):
    """The pulled model of `args.repo`, with the household's `--peer`s as a tier before the Hub."""
    from expertmesh.node.engine.streamed_model import open_model

    sm = open_model(args.repo, revision=args.revision, store_config=_store_config(args))
    if args.peer or getattr(args, "discover", False):
        from expertmesh.node.household.node_id import load_or_create_node_id
        from expertmesh.node.store.tiers.peers import attach_peers

        try:
            source = attach_peers(
                sm, args.peer, _secret(args)[0], load_or_create_node_id(constants.expertmesh_home()), _tls_ca(args)
            )
            if args.remote_compute != "off":
                from expertmesh.node.household.remote_experts import attach_remote_experts

                attach_remote_experts(sm, source)
        except BaseException:
            sm.close()
            raise
    return sm


def _describe(sm) -> str:
    from expertmesh.node.sizes import format_size

    return (
        f"{sm.repo_id} @ {sm.commit[:12]}: core {format_size(sm.core_bytes)} in memory; "
        f"experts from RAM ({format_size(sm.store.ram.budget_bytes)}), "
        f"disk cache ({format_size(sm.disk.budget_bytes)} at {sm.disk.root}), then the Hub"
    )


def _generate_once(sm, prompt: str, args: argparse.Namespace) -> None:
    from expertmesh.cli.terminal import StopFlag, ctrl_c_stops, print_summary, stream_text
    from expertmesh.node.engine.generation import GenerationSummary, Generator

    tokens = sm.tokenizer.encode(prompt)
    summary = GenerationSummary()
    with ctrl_c_stops(StopFlag()) as flag:
        stream_text(Generator(sm, _speculation(args)).generate(tokens, _sampling(args), flag, summary), summary)
    print_summary(summary)


def _cmd_run(args: argparse.Namespace) -> int:
    _speculation(args)  # a bad --speculate/--draft fails before the model loads
    sm = _open_model(args)
    metrics = None
    try:
        print(_describe(sm), file=sys.stderr)
        metrics = _start_metrics(args, sm)
        _generate_once(sm, args.prompt, args)
    finally:
        if metrics is not None:
            metrics.stop()
        sm.close()
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from expertmesh.cli.terminal import chat_loop
    from expertmesh.node.engine.chat import ChatSession
    from expertmesh.node.engine.generation import Generator

    _speculation(args)
    sm = _open_model(args)
    try:
        print(_describe(sm), file=sys.stderr)
        print("type a message; Ctrl-C stops a reply, Ctrl-D or /exit ends the chat", file=sys.stderr)
        session = ChatSession(Generator(sm, _speculation(args)), system_prompt=args.system)
        settings = _sampling(args)
        chat_loop(lambda text, stop, summary: session.reply(text, settings, stop, summary))
    finally:
        sm.close()
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Make (or reuse) the demo model, serve it from a local Hub inside this process, pull it and
    generate with experts fetched from that Hub on demand."""
    from expertmesh.node.devtools.local_hub import HubServer
    from expertmesh.node.devtools.tiny.demo_model import make_demo_model, make_draft_model
    from expertmesh.node.engine.streamed_model import open_model
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    hub_dir = constants.expertmesh_home() / "demo" / "hub"
    repo_dir = hub_dir / DEMO_REPO
    if not (repo_dir / "config.json").is_file():
        print(f"making the demo model {DEMO_REPO} (a tiny Kimi K3 trained on Python's docstrings) in {repo_dir}")
        make_demo_model(repo_dir)
    draft_dir = hub_dir / DEMO_DRAFT_REPO  # its draft model, for --speculate draft here and with `run`
    if not (draft_dir / "config.json").is_file():
        make_draft_model(draft_dir)
    if args.draft is None:
        args.draft = str(draft_dir)  # the folder: no second download from the Hub it serves
    with HubServer(hub_dir, host="127.0.0.1", port=0) as hub, hub_client.using_endpoint(hub.url):
        print(f"1. serving it with a local Hub at {hub.url}")
        print("2. pulling the core (never the experts)")
        result = pull(DEMO_REPO, progress=not args.no_progress)
        _print_pull(result)
        pulled = hub.stats()
        print(
            f"   the Hub served {format_size(pulled.get('bytes_served', 0))} in {pulled.get('requests', 0)} "
            f"requests (core {format_size(result.fetched_bytes)}, the rest headers, config and tokenizer)"
        )
        sm = open_model(DEMO_REPO, store_config=_store_config(args))
        try:
            print(f"3. generating: {_describe(sm)}")
            print(f"   prompt: {args.prompt!r}")
            sys.stdout.flush()
            _generate_once(sm, args.prompt, args)
        finally:
            sm.close()
        served = hub.stats().get("bytes_served", 0) - pulled.get("bytes_served", 0)
    if served:
        print(
            f"   the Hub served {format_size(served)} of experts during generation; run `expertmesh demo` "
            "again and they come from the disk cache"
        )
    else:
        print("   the Hub served no experts: every one came from this machine's caches")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from expertmesh.node.household.node_id import load_or_create_node_id
    from expertmesh.node.rpc.server import start_node_server
    from expertmesh.node.rpc.service import NodeService
    from expertmesh.node.store.tiers.peers import PeerTable

    home = constants.expertmesh_home()
    secret, created = _secret(args)
    node_id = load_or_create_node_id(home)
    if args.cache_only:
        from expertmesh.node.store.served import open_cache_peer

        sm, experts = None, open_cache_peer(args.repo, args.revision, home, args.disk_budget)
        table = PeerTable(node_id, float(experts.disk.budget_bytes))  # followed for the household view only
        close = experts.close
    else:
        sm, experts = _open_model(args), None
        table = next(s for s in sm.store.sources if s.name == "peer").table if args.discover or args.peer else None
        close = sm.close
    try:
        service = NodeService(
            sm, node_id, experts, peers=table, speculation=_speculation(args) if sm is not None else None
        )
        ex = service.experts
        metrics = _start_metrics(args, sm, experts, table)  # first: its daemon thread needs no stopping on an error
        tls = None
        if args.tls_cert or args.tls_key:
            from expertmesh.node.rpc.tls import TlsConfigError, server_credentials

            if not (args.tls_cert and args.tls_key):
                raise TlsConfigError("TLS needs both --tls-cert and --tls-key")
            tls = server_credentials(args.tls_cert, args.tls_key)
        running = start_node_server(service, secret, host=args.host, port=args.port, tls=tls)
        print(f"{service.role} node {node_id} serving {ex.repo_id} @ {ex.commit[:12]} on {args.host}:{running.port}")
        discovery = None
        if args.discover:
            from expertmesh.node.household.discovery import Advertisement, Discovery

            address = args.interface or (args.host if args.host not in ("0.0.0.0", "") else _lan_address())
            ad = Advertisement(
                node_id,
                args.cluster,
                service.role,
                running.port,
                ex.disk.budget_bytes,
                metrics_port=metrics.port if metrics is not None else 0,
                compute=service.computer is not None,
            )
            discovery = Discovery(table, ad, address, [args.interface] if args.interface else None)
            print(f"advertising in cluster {args.cluster!r} as {address}:{running.port}; peers join as they appear")
        api = _start_api(args, ex.repo_id, secret, running.port, table)
        print(
            _describe(sm)
            if sm is not None
            else f"cache peer: experts on disk ({format_size(ex.disk.budget_bytes)} at {ex.disk.root}), the Hub on a miss"
        )
        if created:
            print("created a household secret; to join another Mac, run there:")
            print(f"  EXPERTMESH_SECRET={secret} expertmesh serve {args.repo}")
        sys.stdout.flush()
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        print("stopping", file=sys.stderr)
        if discovery is not None:
            discovery.close()
        if api is not None:
            api.stop()
        running.stop()
        if metrics is not None:
            metrics.stop()
    finally:
        close()
    # Everything is stopped and every cached file was published atomically. A node that fetched
    # from peers sometimes dies in a C++ destructor at interpreter exit ("terminate called without
    # an active exception", grpc or MLX threads); skip those destructors: there is nothing left to save.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_api(args: argparse.Namespace, repo_id: str, secret: str, grpc_port: int, table):
    """The embedded coordinator's OpenAI-compatible API (None with --no-http): this node, if it is a
    full node, and the full nodes the peer table follows."""
    if args.http_port is None:
        return None
    from expertmesh.coordinator.node_pool import NodePool
    from expertmesh.coordinator.openai_api import Coordinator, CoordinatorConfig, OpenAIServer

    local = [] if args.cache_only else [f"{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{grpc_port}"]
    pool = NodePool.following(local, table) if table is not None else NodePool(local)
    config = CoordinatorConfig(
        secret=secret, models=lambda: [repo_id], tls_ca=_tls_ca(args), max_waiting=args.max_waiting
    )
    try:
        api = OpenAIServer(Coordinator(config, pool), args.http_host, args.http_port)
    except OSError as e:
        raise ExpertmeshError(
            f"cannot serve the HTTP API on {args.http_host}:{args.http_port}: {e.strerror or e}"
        ) from None
    print(f"OpenAI-compatible API on {api.url} (model {repo_id!r})")
    return api


def _start_metrics(args: argparse.Namespace, sm, experts=None, peers=None):
    """Serve `/metrics` if asked (`--metrics-port`; None or `--no-metrics`: not served); prints the address."""
    if getattr(args, "metrics_port", None) is None:
        return None
    from expertmesh.node.observability.metrics import NodeMetrics

    metrics = NodeMetrics.for_model(sm, peers) if sm is not None else NodeMetrics.for_served(experts, peers)
    host = args.metrics_host or getattr(args, "host", None) or "127.0.0.1"
    try:
        server = metrics.serve(host, args.metrics_port)
    except OSError as e:
        raise ExpertmeshError(f"cannot serve metrics on {host}:{args.metrics_port}: {e.strerror or e}") from None
    print(f"metrics on {server.url}", file=sys.stderr)
    return server


def _cmd_prometheus_targets(args: argparse.Namespace) -> int:
    """Keep a Prometheus file_sd file in step with the metrics ports the cluster's nodes advertise."""
    import threading

    from expertmesh.node.observability.prometheus_targets import TargetsWatcher

    watcher = TargetsWatcher(Path(args.file), args.cluster, [args.interface] if args.interface else None)
    print(
        f"keeping {args.file} in step with the nodes of cluster {args.cluster!r}"
        + ("" if args.once else "; Ctrl-C stops"),
        file=sys.stderr,
    )
    try:
        threading.Event().wait(args.wait) if args.once else threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        watcher.close()
    print(f"{len(watcher.targets())} nodes serve metrics: {args.file}", file=sys.stderr)
    return 0


def _lan_address() -> str:
    """This machine's address on the default route (no packet is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only selects the interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def _household(args: argparse.Namespace):
    """A PeerTable of the nodes found by zeroconf (for `--wait` s, unless --no-discovery) and --peer."""
    import time

    from expertmesh.node.household.discovery import Advertisement, Discovery
    from expertmesh.node.store.tiers.peers import Peer, PeerTable

    table = PeerTable(self_id="expertmesh-cli", self_weight=0.0)
    for address in args.peer:
        table.add(Peer(address, address, 0.0))
    if args.discover:
        d = Discovery(
            table,
            Advertisement(table.self_id, args.cluster, "cli", 0, 0),
            None,
            [args.interface] if args.interface else None,
            advertise=False,
        )
        time.sleep(args.wait)
        d.settle()
        d.close()
    return table


def _known_secret() -> str:
    """The household secret for a command that joins no household: the environment, else the home's."""
    secret = constants.household_secret() or ""
    kept = constants.expertmesh_home() / constants.SECRET_FILENAME
    if not secret and kept.is_file():
        secret = kept.read_text().strip()
    return secret


def _cmd_warm(args: argparse.Namespace) -> int:
    """Every node keeps the experts it owns, most used first, into free disk budget."""
    import threading
    from collections import Counter

    from tqdm import tqdm

    from expertmesh.node.household.warm import describe_nodes, warm, warm_order
    from expertmesh.node.hub import local_models
    from expertmesh.node.hub.expert_index import INDEX_FILENAME, ExpertIndex
    from expertmesh.node.observability.routing_trace import read_trace

    index = ExpertIndex.load(
        local_models.find_index(constants.expertmesh_home(), args.repo, args.revision) / INDEX_FILENAME
    )
    uses: Counter = Counter()
    for path in args.trace:
        try:
            uses.update(read_trace(Path(path)).accesses())
        except (OSError, ValueError) as e:
            raise ExpertmeshError(f"cannot read trace {path}: {e}") from None
    secret = _known_secret()
    tls_ca = _tls_ca(args)
    nodes, skipped = describe_nodes(sorted(p.address for p in _household(args).peers.values()), index, secret, tls_ca)
    for line in skipped:
        print(f"skipping {line}", file=sys.stderr)
    if not nodes:
        raise ExpertmeshError(
            f"no node serving {index.repo_id}@{index.commit[:12]} was found "
            "(is multicast blocked? try --peer HOST:PORT)"
        )
    order = warm_order(index, uses)
    print(
        f"warming {len(order)} experts of {index.repo_id}@{index.commit[:12]} on {len(nodes)} nodes, "
        f"{'most used first (' + str(len(args.trace)) + ' traces)' if args.trace else 'spread across layers'}",
        file=sys.stderr,
    )
    stop = threading.Event()
    with tqdm(total=len(order), unit="expert", disable=None, file=sys.stderr) as bar:
        try:
            results = warm(index, nodes, secret, order, args.concurrency, lambda done, _: bar.update(1), stop, tls_ca)
        except KeyboardInterrupt:
            print("stopped: what was kept stays kept; run warm again to go on", file=sys.stderr)
            return 130
    for r in results:
        state = "budget full" if r.full else (f"left out: {r.unreachable}" if r.unreachable else "done")
        errors = f", errors {dict(r.errors)}" if r.errors else ""
        print(
            f"{r.node_id:<18} {r.address:<22} owns {r.owned:>7}, held {r.held:>7}, kept {r.kept:>7} "
            f"({format_size(r.kept_bytes)}), left {r.left:>7}: {state}{errors}"
        )
    return 1 if any(r.unreachable for r in results) else 0


def _cmd_status(args: argparse.Namespace) -> int:
    """The household's headline numbers: every node's fill and throughput, uses by source."""
    from expertmesh.coordinator.status import ask_all, status_lines

    nodes = ask_all(sorted(p.address for p in _household(args).peers.values()), _known_secret(), _tls_ca(args))
    print("\n".join(status_lines(nodes)))
    return 0 if nodes and all(n.info is not None for n in nodes) else 1


def _cmd_peers(args: argparse.Namespace) -> int:
    """The household as this machine sees it: every node found (zeroconf and --peer), asked for Info."""
    from expertmesh.coordinator.status import ask_all

    table = _household(args)
    names = {p.address: p.node_id for p in table.peers.values()}
    print(f"{'node':<18} {'address':<22} {'role':<6} {'model':<40} {'disk used / budget':>22}")
    for n in ask_all(sorted(names), _known_secret(), _tls_ca(args)):
        info = n.info
        if info is None:
            print(f"{names[n.address]:<18} {n.address:<22} {'?':<6} {'(' + n.error + ')':<40}")
            continue
        model = ", ".join(f"{m.repo_id}@{m.commit[:8]}" for m in info.models)
        disk = f"{format_size(info.disk_used_bytes)} / {format_size(info.disk_budget_bytes)}"
        print(f"{info.node_id:<18} {n.address:<22} {info.role:<6} {model:<40} {disk:>22}")
    if not table.peers:
        print("no nodes found (is multicast blocked? try --peer HOST:PORT)")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from expertmesh.node.observability.routing_trace import read_trace, replay

    try:
        trace = read_trace(Path(args.trace))
    except (OSError, ValueError) as e:
        raise ExpertmeshError(str(e)) from None
    slots = []
    for b in args.budgets.split(","):
        b = b.strip()
        slots.append(round(trace.total_experts * float(b[:-1]) / 100) if b.endswith("%") else int(b))
    accesses = len(trace.accesses())
    print(
        f"{trace.repo} @ {trace.commit[:12]}: {trace.passes} passes, {accesses} expert uses, "
        f"{trace.total_experts} experts in {len(trace.experts_per_layer)} MoE layers"
    )
    table = replay(trace, slots, args.policies.split(",") if args.policies else None)
    print(f"{'RAM hit rate':<14}" + "".join(f"{n:>8} ({100 * n / trace.total_experts:.0f}%)" for n in slots))
    for name, rates in table.items():
        print(f"{name:<14}" + "".join(f"{rates[n]:>14.3f}" for n in slots))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from expertmesh.node.devtools.bench import print_table, run_bench, write_json

    doc = run_bench(
        model=args.model,
        tokens=args.tokens,
        time_scale=args.time_scale,
        ram_fraction=args.ram_fraction,
        naive_tokens=args.naive_tokens,
        hub_connections=args.hub_connections,
        progress=lambda m: print(m, file=sys.stderr),
    )
    print_table(doc)
    if args.json:
        write_json(doc, Path(args.json))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _budget(text: str) -> str:
    from expertmesh.node.sizes import parse_budget

    try:
        parse_budget(text, 1)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return n


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", help="branch, tag or commit sha (default: what was pulled from main)")
    p.add_argument(
        "--ram-budget",
        type=_budget,
        default=constants.DEFAULT_RAM_BUDGET,
        help="RAM for experts: a size (8GB) or a %% of the memory the core leaves (default %(default)s)",
    )
    p.add_argument(
        "--disk-budget",
        type=_budget,
        default=constants.DEFAULT_DISK_BUDGET,
        help="disk for cached experts: a size or a %% of free space (default %(default)s)",
    )
    p.add_argument(
        "--ram-policy",
        choices=list(POLICIES),
        default=DEFAULT_POLICY,
        help="which experts RAM keeps (default %(default)s, chosen by `expertmesh replay` on traces)",
    )
    p.add_argument("--trace", metavar="FILE", help="record the routed experts of every layer and pass to FILE")
    p.add_argument("--no-prefetch", action="store_true", help="do not guess and fetch the next layer's experts")
    p.add_argument(
        "--no-fill",
        action="store_true",
        help="do not use the idle link while generating to fetch "
        "experts not yet held onto free disk budget (it never evicts)",
    )
    p.add_argument(
        "--hub-connections",
        type=_positive_int,
        default=constants.HUB_CONNECTIONS,
        metavar="N",
        help="range requests in flight to the Hub at once (default %(default)s)",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a node of the household to ask for experts before the Hub (repeatable)",
    )
    p.add_argument(
        "--remote-compute",
        choices=("auto", "off"),
        default="auto",
        help="auto (default): run experts on the peers that hold them when the measured costs say it is "
        "faster than fetching them (move activations, not experts); off: always fetch the experts",
    )
    _add_tls_ca_argument(p)


def _add_household_arguments(p: argparse.ArgumentParser) -> None:
    """How a command that joins no household finds its nodes (see `_household`)."""
    p.add_argument("--cluster", default="home")
    p.add_argument("--interface", metavar="IP", help="browse on this address only")
    p.add_argument("--no-discovery", dest="discover", action="store_false", help="only the --peer addresses")
    p.add_argument("--peer", action="append", default=[], metavar="HOST:PORT")
    p.add_argument("--wait", type=float, default=3.0, help="seconds to listen for advertisements (default %(default)s)")
    _add_tls_ca_argument(p)


def _add_tls_ca_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="the household's TLS certificate: call nodes over TLS (default $EXPERTMESH_TLS_CA; plain TCP if neither)",
    )


def _add_metrics_arguments(p: argparse.ArgumentParser, default: int | None) -> None:
    p.add_argument(
        "--metrics-port",
        type=int,
        default=default,
        metavar="N",
        help="serve Prometheus /metrics on port N (0 picks a free one and prints it)"
        + ("; default 0" if default == 0 else "; default: not served"),
    )
    p.add_argument("--metrics-host", help="address for /metrics (default: the same as --host, else 127.0.0.1)")
    p.add_argument("--no-metrics", dest="metrics_port", action="store_const", const=None, help="do not serve /metrics")


def _add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    p.add_argument(
        "--max-tokens", type=int, default=max_tokens, help="tokens to generate at most (default %(default)s)"
    )
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--seed", type=int, help="random seed: the same seed gives the same text")


def _add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    from expertmesh.node.engine.speculative import DEFAULT_MODE, MODES

    p.add_argument(
        "--speculate",
        choices=MODES,
        default=DEFAULT_MODE,
        help="draft tokens and verify them in one pass: ngram (prompt look-up), draft (--draft "
        "model) or off (default %(default)s, chosen by benchmarks/bench_speculative.py)",
    )
    p.add_argument(
        "--draft",
        metavar="REPO",
        help="draft model for --speculate draft: a folder or repo id of a small mlx-lm model with the same tokenizer",
    )


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
    p.add_argument("--index-only", action="store_true", help="only the expert index (for `serve --cache-only`)")
    p.add_argument(
        "--core-bits",
        type=int,
        choices=[16, 8],
        metavar="{16,8}",
        help="8 stores and runs the core as MLX 8-bit weights (about half the memory; experts keep "
        "their precision); default: 16 (BF16) for a new pull, else what is pulled",
    )
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
    from expertmesh.node.devtools.local_hub import add_knob_arguments

    add_knob_arguments(p)
    p.set_defaults(func=_cmd_hub)

    p = sub.add_parser("run", help="generate text from a prompt on a pulled model")
    p.add_argument("repo", help="Hugging Face repo id of a pulled model")
    p.add_argument("prompt", help="the prompt (raw text, no chat template)")
    _add_model_arguments(p)
    _add_sampling_arguments(p)
    _add_speculation_arguments(p)
    _add_metrics_arguments(p, default=None)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("chat", help="chat with a pulled model (its chat template, multi-turn)")
    p.add_argument("repo", help="Hugging Face repo id of a pulled model")
    p.add_argument("--system", help="system prompt")
    _add_model_arguments(p)
    _add_sampling_arguments(p, max_tokens=512)
    _add_speculation_arguments(p)
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("serve", help="run a node: the gRPC node service for a pulled model")
    p.add_argument("repo", help="Hugging Face repo id of a pulled model")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default all interfaces)")
    p.add_argument(
        "--port", type=int, default=constants.DEFAULT_NODE_PORT, help="0 picks a free port (default %(default)s)"
    )
    p.add_argument("--secret", help="the household secret (default EXPERTMESH_SECRET, else the one kept in the home)")
    p.add_argument("--cluster", default="home", help="zeroconf cluster name: nodes join their own cluster only")
    p.add_argument("--interface", metavar="IP", help="advertise and browse on this address only")
    p.add_argument(
        "--no-discovery",
        dest="discover",
        action="store_false",
        help="no zeroconf: peers only from --peer (where multicast does not work)",
    )
    p.add_argument(
        "--cache-only",
        action="store_true",
        help="a cache peer: no core and no compute, only expert bytes (needs `pull --index-only`)",
    )
    p.add_argument(
        "--tls-cert", metavar="PEM", help="serve over TLS with the household certificate (see node/rpc/tls.py)"
    )
    p.add_argument("--tls-key", metavar="PEM", help="the key of --tls-cert")
    p.add_argument("--http-host", default="127.0.0.1", help="the OpenAI-compatible API's address (default %(default)s)")
    p.add_argument(
        "--http-port",
        type=int,
        default=8000,
        metavar="N",
        help="the OpenAI-compatible API's port (default %(default)s; 0 picks a free one)",
    )
    p.add_argument("--no-http", dest="http_port", action="store_const", const=None, help="no HTTP API")
    p.add_argument(
        "--max-waiting",
        type=int,
        default=16,
        metavar="N",
        help="requests that may wait for a generation slot before the API answers 429 (default %(default)s)",
    )
    _add_metrics_arguments(p, default=0)
    _add_model_arguments(p)
    _add_speculation_arguments(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("peers", help="the nodes of the household: found by zeroconf (and --peer), with their Info")
    _add_household_arguments(p)
    p.set_defaults(func=_cmd_peers)

    p = sub.add_parser("status", help="the household's headline numbers: fill, throughput, expert uses by source")
    _add_household_arguments(p)
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("warm", help="every node keeps the experts it owns, most used first, into free disk budget")
    p.add_argument("repo", help="a model pulled here (`pull --index-only` is enough)")
    p.add_argument("--revision", default=None)
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FILE",
        help="routing traces (`run --trace`) that rank experts by use (repeatable)",
    )
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per node (default %(default)s)")
    _add_household_arguments(p)
    p.set_defaults(func=_cmd_warm)

    p = sub.add_parser(
        "prometheus-targets", help="keep a Prometheus file_sd file in step with the nodes zeroconf finds"
    )
    p.add_argument("file", help="the targets file (e.g. deploy/prometheus/targets/nodes.json), replaced atomically")
    p.add_argument("--cluster", default="home")
    p.add_argument("--interface", metavar="IP", help="browse on this address only")
    p.add_argument("--once", action="store_true", help="listen for --wait seconds, write the file and exit")
    p.add_argument("--wait", type=float, default=3.0, help="seconds to listen with --once (default %(default)s)")
    p.set_defaults(func=_cmd_prometheus_targets)

    p = sub.add_parser("replay", help="hit rates of each RAM policy and of the offline optimum on a trace")
    p.add_argument("trace", help="a file written by `run --trace`")
    p.add_argument("--budgets", default="10%,25%,50%", help="experts RAM holds: counts or %% of all experts")
    p.add_argument("--policies", help=f"comma-separated, from {', '.join(POLICIES)} (default: all)")
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser("bench", help="naive, cold, warm-disk, warm-RAM and mlx-lm side by side on an emulated link")
    p.add_argument(
        "--model",
        default="demo",
        help="demo (the trained demo model), tiny-ARCH, or wide-kimi_k3 (a wider random K3) (default %(default)s)",
    )
    p.add_argument("--tokens", type=int, default=24, help="tokens per prompt (default %(default)s)")
    p.add_argument(
        "--naive-tokens", type=int, default=8, help="tokens of the slow naive run, on the first prompt (0 skips it)"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=constants.BENCH_TIME_SCALE,
        help="emulated link seconds per K3 second (default %(default)s)",
    )
    p.add_argument("--ram-fraction", type=float, default=0.25, help="RAM budget as a fraction of all experts")
    p.add_argument(
        "--hub-connections",
        type=_positive_int,
        default=constants.HUB_CONNECTIONS,
        metavar="N",
        help="range requests in flight to the Hub in cold and warm_disk (default %(default)s)",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("demo", help="the whole path on a built-in tiny model, no internet needed")
    p.add_argument("--prompt", default="Return the number of", help="what to generate from")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_model_arguments(p)
    _add_sampling_arguments(p, max_tokens=48)
    _add_speculation_arguments(p)  # --speculate draft uses the demo's draft model unless --draft says otherwise
    p.set_defaults(
        func=_cmd_demo, temp=0.5, seed=0, speculate="off"
    )  # a tiny model loops when greedy; seeded, it stays repeatable
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # transformers (under mlx-lm's tokenizer) warns that it does not know our model types; it need not
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
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
