"""Flags shared by several commands, and how they become the node's config dataclasses."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from expertmesh.node import constants
from expertmesh.node.config import (
    DEFAULT_RAM_POLICY,
    DEFAULT_SPECULATION,
    RAM_POLICIES,
    SPECULATION_MODES,
    HouseholdConfig,
    SpeculationConfig,
    StoreConfig,
)

# -- value types ----------------------------------------------------------------------------


def budget(text: str) -> str:
    """A size (8GB) or a percentage (50%), checked now so a typo fails before the model loads."""
    from expertmesh.node.sizes import parse_budget

    try:
        parse_budget(text, 1)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return n


# -- flag groups ----------------------------------------------------------------------------


def add_store_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--revision", help="branch, tag or commit sha (default: what was pulled from main)")
    p.add_argument(
        "--ram-budget",
        type=budget,
        default=constants.DEFAULT_RAM_BUDGET,
        help="RAM for experts: a size (8GB) or a %% of the memory the core leaves (default %(default)s)",
    )
    p.add_argument(
        "--disk-budget",
        type=budget,
        default=constants.DEFAULT_DISK_BUDGET,
        help="disk for cached experts: a size or a %% of free space (default %(default)s)",
    )
    p.add_argument(
        "--ram-policy",
        choices=RAM_POLICIES,
        default=DEFAULT_RAM_POLICY,
        help="which experts RAM keeps (default %(default)s, chosen by `expertmesh replay` on traces)",
    )
    p.add_argument("--trace", metavar="FILE", help="record the routed experts of every layer and pass to FILE")
    p.add_argument("--no-prefetch", action="store_true", help="do not guess and fetch the next layer's experts")
    p.add_argument(
        "--no-fill",
        action="store_true",
        help="do not use the idle link while generating to fetch experts not yet held onto free disk budget",
    )
    p.add_argument(
        "--hub-connections",
        type=positive_int,
        default=constants.HUB_CONNECTIONS,
        metavar="N",
        help="range requests in flight to the Hub at once (default %(default)s)",
    )


def add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """How a generating node uses the household: `--peer`s and remote expert execution."""
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
    add_secret_arguments(p)
    add_tls_ca_argument(p)


def add_household_lookup_arguments(p: argparse.ArgumentParser) -> None:
    """How a command that joins no household finds its nodes (see `find_household`)."""
    p.add_argument("--cluster", default="home")
    p.add_argument("--interface", metavar="IP", help="browse on this address only")
    p.add_argument("--no-discovery", dest="discover", action="store_false", help="only the --peer addresses")
    p.add_argument("--peer", action="append", default=[], metavar="HOST:PORT")
    p.add_argument("--wait", type=float, default=3.0, help="seconds to listen for advertisements (default %(default)s)")
    add_secret_arguments(p)
    add_tls_ca_argument(p)


def add_secret_arguments(p: argparse.ArgumentParser) -> None:
    """--secret-file and --secret, for every command that talks to nodes. A file is the way that
    keeps the secret out of `ps` (any user of the Mac can read another's command lines)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--secret-file",
        metavar="PATH",
        help="read the household secret from PATH, a file only you can read (default: EXPERTMESH_SECRET, "
        "else the one kept in the home; `expertmesh secret` shows it)",
    )
    g.add_argument(
        "--secret",
        help="the household secret itself: it shows in `ps` to every user of this machine, so prefer "
        "--secret-file or EXPERTMESH_SECRET",
    )


def add_tls_ca_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="the household's TLS certificate: call nodes over TLS (default $EXPERTMESH_TLS_CA; plain TCP if neither)",
    )


def add_metrics_arguments(p: argparse.ArgumentParser, default: int | None) -> None:
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


def add_sampling_arguments(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    p.add_argument(
        "--max-tokens", type=int, default=max_tokens, help="tokens to generate at most (default %(default)s)"
    )
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature; 0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1: off)")
    p.add_argument("--seed", type=int, help="random seed: the same seed gives the same text")


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculate",
        choices=SPECULATION_MODES,
        default=DEFAULT_SPECULATION,
        help="draft tokens and verify them in one pass: ngram (prompt look-up), draft (--draft "
        "model) or off (default %(default)s, chosen by benchmarks/bench_speculative.py)",
    )
    p.add_argument(
        "--draft",
        metavar="REPO",
        help="draft model for --speculate draft: a folder or repo id of a small mlx-lm model with the same tokenizer",
    )


# -- flags -> config ------------------------------------------------------------------------


def store_config(args: argparse.Namespace) -> StoreConfig:
    return StoreConfig(
        ram_budget=args.ram_budget,
        disk_budget=args.disk_budget,
        ram_policy=args.ram_policy,
        trace_path=Path(args.trace) if args.trace else None,
        prefetch=not args.no_prefetch,
        fill=not args.no_fill,
        hub_connections=args.hub_connections,
    )


def sampling(args: argparse.Namespace):
    from expertmesh.node.engine.generation import SamplingSettings

    return SamplingSettings(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, seed=args.seed)


def speculation(args: argparse.Namespace) -> SpeculationConfig | None:
    """--speculate/--draft as a SpeculationConfig (None: off). Raises SpeculationError on a bad pair."""
    mode = getattr(args, "speculate", "off")
    return None if mode == "off" else SpeculationConfig(mode=mode, draft_repo=getattr(args, "draft", None))


def home_secret_path() -> Path:
    """Where the home keeps the household secret (owner-only); `serve` creates it, `secret` shows it."""
    return constants.expertmesh_home() / constants.SECRET_FILENAME


def _read_kept(path: Path) -> str:
    """The secret in `path`, with a warning (never the secret) when other users may read the file."""
    from expertmesh.node.rpc.auth import loosely_readable, read_secret_file

    secret = read_secret_file(path)
    if loosely_readable(path):
        print(f"warning: other users of this machine can read {path}: chmod 600 {path}", file=sys.stderr)
    return secret


def given_secret(args: argparse.Namespace) -> tuple[str, str] | None:
    """(secret, where it came from) from --secret, --secret-file or EXPERTMESH_SECRET, in that order;
    None if none was given. The source names a flag, variable or file, so errors can say which."""
    from expertmesh.node.rpc.auth import check_secret

    if getattr(args, "secret", None) is not None:
        return check_secret(args.secret.strip(), "--secret"), "--secret"
    if getattr(args, "secret_file", None):
        path = Path(args.secret_file).expanduser()
        return _read_kept(path), f"--secret-file {path}"
    env = constants.household_secret()
    if env is not None:
        return check_secret(env.strip(), "EXPERTMESH_SECRET"), "EXPERTMESH_SECRET"
    return None


def secret(args: argparse.Namespace) -> tuple[str, bool]:
    """The household secret of a node that joins the household (serve, run/chat with --peer):
    --secret, --secret-file, EXPERTMESH_SECRET, else the one kept in the home (created if none);
    (secret, created). Raises SecretError (one line, never the value) for an unusable one."""
    from expertmesh.node.rpc.auth import load_or_create_secret

    given = given_secret(args)
    if given is not None:
        return given[0], False
    path = home_secret_path()
    if path.exists():
        return _read_kept(path), False
    return load_or_create_secret(path)


def known_secret(args: argparse.Namespace) -> tuple[str, str]:
    """(secret, where it came from) for a command that asks nodes but joins no household (peers,
    status, warm): as `secret`, but it never creates one — a new secret could only be refused."""
    from expertmesh.node.rpc.auth import SecretError

    given = given_secret(args)
    if given is not None:
        return given
    path = home_secret_path()
    if not path.exists():
        raise SecretError(
            f"no household secret here ({path} does not exist): pass --secret-file PATH with a copy of "
            "the household's (`expertmesh secret` on a node shows it), or set EXPERTMESH_SECRET"
        )
    return _read_kept(path), str(path)


def tls_ca(args: argparse.Namespace) -> bytes | None:
    """The household CA for calls to other nodes: --tls-ca, $EXPERTMESH_TLS_CA, or a serving node's own cert."""
    from expertmesh.node.rpc.tls import load_ca

    return load_ca(getattr(args, "tls_ca", None) or getattr(args, "tls_cert", None))


def household_config(args: argparse.Namespace, discover: bool = False) -> HouseholdConfig | None:
    """The household a generating node joins (None: it runs alone, with no peers to ask)."""
    if not (args.peer or discover):
        return None
    from expertmesh.node.config import RemoteConfig

    return HouseholdConfig(
        secret=secret(args)[0],
        peers=list(args.peer),
        discover=discover,
        cluster=getattr(args, "cluster", "home"),
        interface=getattr(args, "interface", None),
        tls_ca=tls_ca(args),
        remote=RemoteConfig() if args.remote_compute != "off" else None,
    )


def find_household(args: argparse.Namespace):
    """A PeerTable of the nodes zeroconf finds in `--wait` seconds (unless --no-discovery), and --peer's."""
    import threading

    from expertmesh.node.household.discovery import Browser
    from expertmesh.node.household.membership import Peer, PeerTable

    table = PeerTable(self_id="expertmesh-cli", self_weight=0.0)
    for address in args.peer:
        table.add(Peer(address, address, 0.0))
    if args.discover:

        def seen(name: str, sighting) -> None:
            if sighting is not None and sighting.ad.cluster == args.cluster:
                ad = sighting.ad
                table.add(Peer(ad.node_id, sighting.address, float(ad.disk_budget_bytes), ad.role, compute=ad.compute))

        browser = Browser(seen, [args.interface] if args.interface else None)
        try:
            threading.Event().wait(args.wait)
            browser.settle()
        finally:
            browser.close()
    return table
