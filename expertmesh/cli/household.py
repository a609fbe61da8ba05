"""`peers`, `status`, `warm`, `secret` and `prometheus-targets`: the household seen from any machine.

The commands that ask nodes take the household secret as nodes do (--secret-file, --secret,
EXPERTMESH_SECRET, the home's) and fail, non-zero and in one line, when no node takes it — telling
a wrong secret (the node refused it) from a node that did not answer, and never printing the
secret itself: error messages name where it came from.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from expertmesh.cli import arguments
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.sizes import format_size

if TYPE_CHECKING:
    from expertmesh.node.rpc.client import NodeAnswer


def add_commands(sub) -> None:
    p = sub.add_parser("peers", help="the nodes of the household: found by zeroconf (and --peer), with their Info")
    arguments.add_household_lookup_arguments(p)
    p.set_defaults(func=peers)

    p = sub.add_parser("status", help="the household's headline numbers: fill, throughput, expert uses by source")
    arguments.add_household_lookup_arguments(p)
    p.set_defaults(func=status)

    p = sub.add_parser("warm", help="every node keeps the experts it owns, most used first, into free disk budget")
    p.add_argument("repo", type=arguments.repo_id, help="a model pulled here (`pull --index-only` is enough)")
    p.add_argument("--revision", default=None, help="branch, tag or commit sha (default: what was pulled from main)")
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FILE",
        help="routing traces (`run --trace`) that rank experts by use (repeatable)",
    )
    p.add_argument(
        "--concurrency",
        type=arguments.positive_int,
        default=4,
        help="requests in flight per node (default %(default)s)",
    )
    arguments.add_household_lookup_arguments(p)
    p.set_defaults(func=warm)

    p = sub.add_parser(
        "secret", help="print this household's secret (from EXPERTMESH_SECRET or the home) to join another Mac"
    )
    p.add_argument(
        "--create", action="store_true", help="make one in the home if there is none (as the first `serve` does)"
    )
    p.set_defaults(func=show_secret)

    p = sub.add_parser(
        "prometheus-targets", help="keep a Prometheus file_sd file in step with the nodes zeroconf finds"
    )
    p.add_argument("file", help="the targets file (e.g. deploy/prometheus/targets/nodes.json), replaced atomically")
    p.add_argument("--cluster", default="home", help="the household's zeroconf cluster (default %(default)s)")
    p.add_argument("--interface", metavar="IP", help="browse on this address only")
    p.add_argument("--once", action="store_true", help="listen for --wait seconds, write the file and exit")
    p.add_argument(
        "--wait", type=arguments.seconds, default=3.0, help="seconds to listen with --once (default %(default)s)"
    )
    arguments.add_secret_arguments(p)
    arguments.add_tls_ca_argument(p)
    p.set_defaults(func=prometheus_targets)


def no_node_accepted(answers: list[NodeAnswer], source: str) -> str | None:
    """Why no node took the secret (a wrong secret, or no answer at all), or None if one did; the
    rows of the table say what the others did. `source` names where the secret came from."""
    from expertmesh.node.rpc.auth import refused

    if not answers or any(a.info is not None for a in answers):
        return None
    wrong = ", ".join(a.address for a in answers if refused(a.error))
    away = ", ".join(f"{a.address} ({a.error})" for a in answers if not refused(a.error))
    fix_secret = "`expertmesh secret` on a node of the household shows the right one"
    if not away:
        return f"wrong secret: every node found ({wrong}) refused the household secret from {source}; {fix_secret}"
    if not wrong:
        return (
            f"no node answered: {away} unreachable; is `serve` running there, on that port, "
            "and does --tls-ca match its TLS?"
        )
    return (
        f"no node accepted the household secret: {wrong} refused it (wrong secret, from {source}), "
        f"{away} unreachable; {fix_secret}"
    )


def peers(args: argparse.Namespace) -> int:
    """The household as this machine sees it: every node found (zeroconf and --peer), asked for Info."""
    from expertmesh.coordinator.status import shown
    from expertmesh.node.rpc.client import ask_info

    secret, source = arguments.known_secret(args)  # a bad secret fails before the wait for advertisements
    tls_ca = arguments.tls_ca(args)
    table = arguments.find_household(args)
    names = {p.address: p.node_id for p in table.all()}
    print(f"{'node':<18} {'address':<22} {'role':<6} {'model':<40} {'disk used / budget':>22}")
    answers = ask_info(sorted(names), secret, tls_ca)
    for n in answers:
        info = n.info
        if info is None:
            print(f"{shown(names[n.address]):<18} {n.address:<22} {'?':<6} {'(' + n.error + ')':<40}")
            continue
        model = ", ".join(f"{shown(m.repo_id, 96)}@{shown(m.commit[:8])}" for m in info.models[:4])
        disk = f"{format_size(info.disk_used_bytes)} / {format_size(info.disk_budget_bytes)}"
        print(f"{shown(info.node_id):<18} {n.address:<22} {shown(info.role, 8):<6} {model:<40} {disk:>22}")
    sys.stdout.flush()  # the table before the error line, when both go to one terminal
    if not names:
        raise ExpertmeshError("no nodes found (is multicast blocked? try --peer HOST:PORT)")
    why = no_node_accepted(answers, source)
    if why:
        raise ExpertmeshError(why)
    return 0


def status(args: argparse.Namespace) -> int:
    """The household's headline numbers: every node's fill and throughput, uses by source."""
    from expertmesh.coordinator.status import status_lines
    from expertmesh.node.rpc.client import ask_info

    secret, source = arguments.known_secret(args)
    tls_ca = arguments.tls_ca(args)
    addresses = sorted(p.address for p in arguments.find_household(args).all())
    nodes = ask_info(addresses, secret, tls_ca)
    why = no_node_accepted(nodes, source)
    if why:  # not a table of question marks over "no expert has been used yet"
        raise ExpertmeshError(why)
    print("\n".join(status_lines(nodes)))
    return 0 if nodes and all(n.info is not None for n in nodes) else 1


def warm(args: argparse.Namespace) -> int:
    """Every node keeps the experts it owns, most used first, into free disk budget."""
    from collections import Counter

    from tqdm import tqdm

    from expertmesh.node import constants
    from expertmesh.node.household import warm as warming
    from expertmesh.node.hub import local_models
    from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex
    from expertmesh.node.observability.routing_trace import read_trace
    from expertmesh.node.rpc.client import ask_info

    (secret, source), tls_ca = arguments.known_secret(args), arguments.tls_ca(args)  # before any work
    folder = local_models.find_index(constants.expertmesh_home(), args.repo, args.revision)
    index = ExpertIndex.load(folder / INDEX_FILENAME)
    uses: Counter = Counter()
    for path in args.trace:
        try:
            uses.update(read_trace(Path(path)).accesses())
        except (OSError, ValueError) as e:
            raise ExpertmeshError(f"cannot read trace {path}: {e}") from None
    addresses = sorted(p.address for p in arguments.find_household(args).all())
    answers = ask_info(addresses, secret, tls_ca)  # first: a wrong secret is named as such
    for a in answers:
        if a.info is None:
            print(f"skipping {a.address}: {a.error}", file=sys.stderr)
    why = no_node_accepted(answers, source)
    if why:
        raise ExpertmeshError(f"no node serving {index.repo_id}@{index.commit[:12]} was found: {why}")
    answered = [a.address for a in answers if a.info is not None]
    nodes, skipped = warming.describe_nodes(answered, index, secret, tls_ca)
    for line in skipped:
        print(f"skipping {line}", file=sys.stderr)
    if not nodes:
        raise ExpertmeshError(
            f"no node serving {index.repo_id}@{index.commit[:12]} was found "
            "(is multicast blocked? try --peer HOST:PORT)"
        )
    order = warming.warm_order(index, uses)
    ranked = f"most used first ({len(args.trace)} traces)" if args.trace else "spread across layers"
    print(
        f"warming {len(order)} experts of {index.repo_id}@{index.commit[:12]} on {len(nodes)} nodes, {ranked}",
        file=sys.stderr,
    )
    stop = threading.Event()
    with tqdm(total=len(order), unit="expert", disable=None, file=sys.stderr) as bar:
        try:
            results = warming.warm(
                index, nodes, secret, order, args.concurrency, lambda done, _: bar.update(1), stop, tls_ca
            )
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


def show_secret(args: argparse.Namespace) -> int:
    """The household secret on stdout, on request only: `serve` no longer prints it where stdout may
    be a log, so this is how another Mac gets it (`expertmesh secret > FILE`, or over ssh)."""
    from expertmesh.node import constants
    from expertmesh.node.rpc.auth import SecretError, check_secret, load_or_create_secret

    path, created = arguments.home_secret_path(), False
    env = constants.household_secret()
    if env is not None:
        secret, source = check_secret(env.strip(), "EXPERTMESH_SECRET"), "EXPERTMESH_SECRET"
    elif path.exists() or args.create:
        secret, created = load_or_create_secret(path)
        source = str(path)
    else:
        raise SecretError(
            f"no household secret in {path} yet: `expertmesh secret --create` makes one (so does the first `serve`)"
        )
    print(secret)
    print(
        f"(from {source}{', just created' if created else ''}) to join another Mac, keep it there in a file only "
        "you can read and run `expertmesh serve REPO --secret-file FILE`, or save it as that Mac's "
        f"EXPERTMESH_HOME/{constants.SECRET_FILENAME}; peers, status and warm take --secret-file too",
        file=sys.stderr,
    )
    return 0


def prometheus_targets(args: argparse.Namespace) -> int:
    """Keep a Prometheus file_sd file in step with the metrics ports the cluster's nodes advertise."""
    from expertmesh.node.observability.prometheus_targets import TargetsWatcher

    given = arguments.given_secret(args)  # a flag or variable that names an unusable secret is an error
    home = arguments.home_secret_path()
    secret = given[0] if given is not None else (arguments.known_secret(args)[0] if home.exists() else None)
    if secret is None:
        print(
            "warning: no household secret here (--secret-file, EXPERTMESH_SECRET or the home's): every node "
            "advertising in the cluster is listed on its word, unproven",
            file=sys.stderr,
        )
    interfaces = [args.interface] if args.interface else None
    watcher = TargetsWatcher(Path(args.file), args.cluster, interfaces, secret, arguments.tls_ca(args))
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
