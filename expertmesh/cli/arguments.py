"""Flags shared by several commands, and how they become the node's config dataclasses."""

from __future__ import annotations

import argparse
import math
import re
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


def size(text: str) -> str:
    """A size (8GB, 0), checked now so a typo fails before the model loads."""
    from expertmesh.node.sizes import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _int_in(text: str, lo: int, hi: int | None, what: str) -> int:
    """`text` as a whole number in [lo, hi] (hi None: no bound), or argparse's error saying `what`."""
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < lo or (hi is not None and n > hi):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return n


def _float_in(text: str, lo: float, hi: float, what: str) -> float:
    """`text` as a finite number in [lo, hi] (NaN and infinities never pass), or argparse's error."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and lo <= x <= hi):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return x


def positive_int(text: str) -> int:
    return _int_in(text, 1, None, "a whole number of at least 1")


def whole_number(text: str) -> int:
    return _int_in(text, 0, None, "a whole number of at least 0")


def port(text: str) -> int:
    """A TCP port, 0 (a free one) to 65535: checked here, before anything binds or loads."""
    return _int_in(text, 0, 65535, "a port from 0 to 65535")


def mac_memory(text: str) -> int:
    """A Mac's memory: `64GB` counts as Apple counts memory, 64 GiB (memory comes in powers of two)."""
    from expertmesh.node.sizes import parse_size

    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    unit = re.sub(r"[\d.\s]", "", text).lower()
    decimal = {"kb": 1, "mb": 2, "gb": 3, "tb": 4}.get(unit)
    return n * 1024**decimal // 1000**decimal if decimal else n


def seed_number(text: str) -> int:
    """A 64-bit integer, negative ones too (as the OpenAI API takes it)."""
    return _int_in(text, -(2**63), 2**63 - 1, "a 64-bit whole number")


def seconds(text: str) -> float:
    """A duration: finite and not negative."""
    return _float_in(text, 0.0, math.inf, "a finite number of seconds, at least 0")


def temperature(text: str) -> float:
    """0 (greedy) to 2, as the OpenAI API allows."""
    return _float_in(text, 0.0, 2.0, "a temperature from 0 to 2")


def probability(text: str) -> float:
    """0 to 1 (top-p mass; a fraction)."""
    return _float_in(text, 0.0, 1.0, "a number from 0 to 1")


def peer_address(text: str) -> str:
    """A node's HOST:PORT (or [v6]:PORT), checked now: a port left out was reported as a wrong secret."""
    from expertmesh.node.rpc.proof import split_address

    try:
        split_address(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (a node's address is HOST:PORT, e.g. 192.168.1.20:50051)") from None
    return text


_REPO_URL = re.compile(r"https?://(?:www\.)?(?:huggingface\.co|hf\.co)/(?P<repo>[^/?#]+/[^/?#]+)(?:[/?#].*)?")


def repo_id(text: str) -> str:
    """A Hugging Face repo id (namespace/name), checked as the Hub checks it, before anything is
    fetched or looked up: a path such as `../x` is never a repo."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if m := _REPO_URL.fullmatch(text.strip()):  # a repo's page pasted from the browser
        text = m["repo"]
    try:
        validate_repo_id(text)
    except HFValidationError as e:
        raise argparse.ArgumentTypeError(str(e).split("\n")[0]) from None
    if "/" not in text:
        raise argparse.ArgumentTypeError(f"expected a repo id of the form namespace/name, got {text!r}")
    return text


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
        "--no-audit",
        action="store_true",
        help="in a household, do not check each peer's first copy of an expert, and a sample of the rest on the "
        "idle link, against fresh Hub copies (peers' copies are then trusted until `expertmesh verify`), nor "
        "each peer's first computed answer, and a sample of the rest, against this node's own computation",
    )
    p.add_argument(
        "--hub-connections",
        type=positive_int,
        metavar="N",
        help=f"range requests in flight to the Hub at once, fixed (default: {constants.HUB_CONNECTIONS} at first, "
        f"grown up to {constants.HUB_MAX_CONNECTIONS} while more connections carry more)",
    )


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """--max-context and --core-budget: what the memory plan (node/engine/memory.py) counts."""
    p.add_argument(
        "--max-context",
        type=positive_int,
        default=constants.DEFAULT_MAX_CONTEXT,
        metavar="N",
        help="tokens a conversation may hold (prompt and answer): its KV cache and linear-attention state "
        "are planned for, a longer prompt is refused (default %(default)s, at most the model's own)",
    )
    p.add_argument(
        "--core-budget",
        type=budget,
        metavar="SIZE",
        help="memory for the core: a size or a %% of the core; below the core's size it is streamed from the "
        "SSD within it, layer by layer (default: held whole where it fits, else streamed)",
    )
    p.add_argument(
        "--prefix-cache",
        type=budget,
        default=constants.DEFAULT_PREFIX_CACHE,
        metavar="SIZE",
        help="memory for the states of earlier prompts, so a request sharing a prefix with one (a chat's next "
        "turn, an agent's system prompt) feeds only its new tokens; 0 keeps none (default %(default)s)",
    )
    p.add_argument(
        "--prefix-disk-budget",
        type=size,
        default=constants.DEFAULT_PREFIX_DISK_BUDGET,
        metavar="SIZE",
        help="disk under the home for prompt prefixes of 1,024 tokens or more, kept across restarts (least "
        "recently used go first; `expertmesh cache --prefixes` lists them); 0 keeps none (default %(default)s)",
    )


def add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """How a generating node uses the household: `--peer`s and remote expert execution."""
    p.add_argument(
        "--peer",
        type=peer_address,
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


DISCOVERY_WAIT_S = 2.0  # zeroconf answers within a second on a LAN; resolving each node takes a little more


def add_discovery_arguments(p: argparse.ArgumentParser) -> None:
    """How `run` and `chat` find the household with zeroconf, as `serve` does (they advertise nothing)."""
    p.add_argument("--cluster", default="home", help="the household's zeroconf cluster (default %(default)s)")
    p.add_argument("--interface", metavar="IP", help="browse on this address only")
    p.add_argument(
        "--no-discovery",
        dest="discover",
        action="store_false",
        help="do not look for the household with zeroconf: peers only from --peer",
    )
    p.add_argument(
        "--discovery-wait",
        type=seconds,
        default=DISCOVERY_WAIT_S,
        metavar="S",
        help="seconds to listen for the household's nodes before loading the model (default %(default)s); "
        "only when this machine knows the household secret",
    )


def add_household_lookup_arguments(p: argparse.ArgumentParser) -> None:
    """How a command that joins no household finds its nodes (see `find_household`)."""
    p.add_argument("--cluster", default="home", help="the household's zeroconf cluster (default %(default)s)")
    p.add_argument("--interface", metavar="IP", help="browse on this address only")
    p.add_argument("--no-discovery", dest="discover", action="store_false", help="only the --peer addresses")
    p.add_argument(
        "--peer",
        type=peer_address,
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a node to ask besides those zeroconf finds (repeatable)",
    )
    p.add_argument(
        "--wait", type=seconds, default=3.0, help="seconds to listen for advertisements (default %(default)s)"
    )
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
        type=port,
        default=default,
        metavar="N",
        help="serve Prometheus /metrics on port N (0 picks a free one and prints it)"
        + ("; default 0" if default == 0 else "; default: not served"),
    )
    p.add_argument(
        "--metrics-host",
        help="address for /metrics (default: "
        + ("--host's, so the household's Prometheus can scrape it)" if default == 0 else "127.0.0.1)"),
    )
    p.add_argument("--no-metrics", dest="metrics_port", action="store_const", const=None, help="do not serve /metrics")


def add_sampling_arguments(
    p: argparse.ArgumentParser, max_tokens: int = 256, temp: float = 0.0, seed: int | None = None
) -> None:
    """Sampling flags; a command with other defaults (`demo`) passes them here, so --help shows them."""
    p.add_argument(
        "--max-tokens", type=positive_int, default=max_tokens, help="tokens to generate at most (default %(default)s)"
    )
    p.add_argument(
        "--temp", type=temperature, default=temp, help="sampling temperature, 0 to 2; 0 is greedy (default %(default)s)"
    )
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass, 0 to 1 (default 1: off)")
    p.add_argument(
        "--seed",
        type=seed_number,
        default=seed,
        help="random seed: the same seed gives the same text"
        + (" (default %(default)s)" if seed is not None else " (default: a fresh one)"),
    )


def prompt_experts(text: str):
    """--prompt-experts: exact | held | keep | drop | topp:P | budget:SECONDS (node/engine/prompt_experts.py)."""
    from expertmesh.node.engine.prompt_experts import PromptExperts

    try:
        return PromptExperts.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_prompt_experts_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt-experts",
        type=prompt_experts,
        default="exact",
        metavar="MODE",
        help="which experts the prompt uses, to fetch fewer for a cold prompt (decoding stays exact): exact "
        "(default), held (a prompt token's expert not held here is replaced by the best-scored held one), "
        "keep (a token keeps only its held experts, renormalised: fewer to compute; a token holding none as held), "
        "drop (not-held experts dropped, weights renormalised), topp:P (each token keeps its top-P weight), "
        "budget:SECONDS (fetch the most important missing experts that fit SECONDS of the link, the rest as "
        "held); the summary says how many of the prompt's expert uses were substituted",
    )


def add_speculation_arguments(
    p: argparse.ArgumentParser, default: str = DEFAULT_SPECULATION, draft_default: str | None = None
) -> None:
    """--speculate and --draft; `demo` passes its own defaults so --help shows what it really does."""
    why = ", chosen by benchmarks/bench_speculative.py" if default == DEFAULT_SPECULATION else ""
    p.add_argument(
        "--speculate",
        choices=SPECULATION_MODES,
        default=default,
        help="draft tokens and verify them in one pass: ngram (prompt look-up), draft (--draft "
        f"model) or off (default %(default)s{why})",
    )
    p.add_argument(
        "--draft",
        metavar="REPO",
        help="draft model for --speculate draft: a folder, or the repo id of a small mlx-lm model with the same "
        "tokenizer (downloaded into the expertmesh home)" + (f"; default {draft_default}" if draft_default else ""),
    )


def add_batch_arguments(p: argparse.ArgumentParser) -> None:
    """--max-batch: how many requests a node decodes together (node/engine/batching.py)."""
    from expertmesh.node.config import DEFAULT_MAX_BATCH

    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        metavar="N",
        help="requests generated together in one batch, each expert read once per step for all of them "
        f"(default {DEFAULT_MAX_BATCH}, chosen by benchmarks/bench_batching.py); a request speculates "
        "(--speculate) only while it runs alone: drafts cannot be verified inside a batch",
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
        audit=not args.no_audit,
        **(
            {"hub_connections": args.hub_connections, "hub_max_connections": args.hub_connections}
            if args.hub_connections
            else {}
        ),
    )


def sampling(args: argparse.Namespace):
    from expertmesh.node.engine.generation import SamplingSettings

    settings = SamplingSettings(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, seed=args.seed)
    mode = getattr(args, "prompt_experts", None)
    if mode is not None:
        settings.prompt_experts = prompt_experts(mode) if isinstance(mode, str) else mode
    return settings


def max_batch(args: argparse.Namespace) -> int:
    """--max-batch, or its default DEFAULT_MAX_BATCH (only a call running alone speculates)."""
    from expertmesh.node.config import DEFAULT_MAX_BATCH

    n = getattr(args, "max_batch", None)
    return DEFAULT_MAX_BATCH if n is None else n


def speculation(args: argparse.Namespace) -> SpeculationConfig | None:
    """--speculate/--draft as a SpeculationConfig (None: off). Raises SpeculationError on a bad pair.

    A --draft that is not a folder is a repo id: it is downloaded into the home now (once: `args.draft`
    then names the folder), so a bad one fails before the model loads and nothing lands in
    huggingface_hub's own cache."""
    mode = getattr(args, "speculate", "off")
    if mode == "off":
        return None
    config = SpeculationConfig(mode=mode, draft_repo=getattr(args, "draft", None))
    if mode == "draft" and not Path(args.draft).expanduser().is_dir():
        from expertmesh.node.hub import local_models

        args.draft = str(local_models.fetch_draft(constants.expertmesh_home(), args.draft))
        config.draft_repo = args.draft
    return config


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
    from expertmesh.node.household.membership import Peer, PeerTable

    table = PeerTable(self_id="expertmesh-cli", self_weight=0.0)
    for address in args.peer:
        table.add(Peer(address, address, 0.0))
    if args.discover:
        from expertmesh.node.household.lookup import browse

        browse(table, args.cluster, args.interface, args.wait)
    return table


def generating_household(args: argparse.Namespace) -> HouseholdConfig | None:
    """The household `run` or `chat` joins: the --peer nodes, and the nodes of --cluster that zeroconf
    finds (as `serve` finds them) and that take the household secret and serve this model.

    Discovery needs a secret this machine already knows (flag, EXPERTMESH_SECRET or the home's): a
    machine without one has no household to ask, so it neither waits nor creates a secret. A node
    that refuses the secret or serves another model is skipped with one line on stderr, never
    fatal: only --peer addresses must answer (they were asked for by name).
    """
    found: list[str] = []
    known: tuple[str, str] | None = None
    if getattr(args, "discover", False) and args.discovery_wait > 0:
        known = given_secret(args)
        if known is None and home_secret_path().exists():
            known = _read_kept(home_secret_path()), str(home_secret_path())
        if known is not None:
            found = _discovered_nodes(args, known[0])
    config: HouseholdConfig | None = None
    if args.peer:
        config = household_config(args)  # as before: --peer may create the home's secret
    elif found and known is not None:
        from expertmesh.node.config import RemoteConfig

        remote = RemoteConfig() if args.remote_compute != "off" else None
        config = HouseholdConfig(secret=known[0], tls_ca=tls_ca(args), remote=remote)
    if config is None:
        return None
    config.peers = list(dict.fromkeys([*config.peers, *found]))  # found by zeroconf: asked by address
    return config


def _discovered_nodes(args: argparse.Namespace, secret: str) -> list[str]:
    """Addresses of the cluster's nodes that answer Info with `secret` and serve `args.repo`."""
    from expertmesh.node.household.lookup import nodes_serving
    from expertmesh.node.household.node_id import NODE_ID_FILENAME

    try:
        own = (constants.expertmesh_home() / NODE_ID_FILENAME).read_text().strip()
    except OSError:
        own = "expertmesh-cli"
    try:
        found = nodes_serving(
            args.repo, args.cluster, args.interface, args.discovery_wait, secret, tls_ca(args), own, tuple(args.peer)
        )
    except OSError as e:
        print(f"zeroconf could not browse ({e.strerror or e}); use --peer HOST:PORT", file=sys.stderr)
        return []
    for address, why in found.skipped:
        print(f"household: skipping {address}: it {why}", file=sys.stderr)
    if found.addresses:
        print(
            f"household: {len(found.addresses)} node(s) found in cluster {args.cluster!r}: {', '.join(found.addresses)}",
            file=sys.stderr,
        )
    return found.addresses
