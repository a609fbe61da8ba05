"""Everything a node is made from, as plain dataclasses: what `build_node` (expertmesh/assembly.py) reads.

The CLI turns its flags into these; tests and benchmarks write them directly. Objects that are
not settings (an injected Hub reader, a servicer class) are keyword arguments of `build_node`,
not fields here. Nothing in this module imports MLX, gRPC or the Hub client, so parsing a
command line stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from expertmesh.node import constants
from expertmesh.node.errors import SpeculationError
from expertmesh.node.store.policies import DEFAULT_POLICY, POLICIES

SPECULATION_MODES = ("ngram", "draft", "off")
DEFAULT_SPECULATION = "ngram"  # measured by benchmarks/bench_speculative.py (docs/benchmarks.md)
RAM_POLICIES = tuple(POLICIES)
DEFAULT_RAM_POLICY = DEFAULT_POLICY  # chosen by `expertmesh replay` on routing traces (docs/benchmarks.md)


@dataclass
class StoreConfig:
    """Budgets and fetch settings of the expert store; sizes or percentages as on the CLI."""

    # what decoded experts may take, MLX's buffer cache included: a size, or a % of what the core
    # leaves of Metal's recommended working set (the machine's memory without Metal); see engine/memory.py
    ram_budget: str = constants.DEFAULT_RAM_BUDGET
    disk_budget: str = constants.DEFAULT_DISK_BUDGET  # a size, or a % of the free space
    fetch_concurrency: int = constants.EXPERT_FETCH_CONCURRENCY  # experts fetched at once
    ram_policy: str = DEFAULT_RAM_POLICY  # store/policies.py
    trace_path: Path | None = None  # record every layer's routed experts here (`--trace`)
    prefetch: bool = True  # guess the next layer's experts and fetch them behind the demands
    fill: bool = True  # while generating, fetch experts not yet held onto free disk budget when the link is idle
    audit: bool = True  # in a household, check a sample of peers' copies against the Hub on the idle link
    hub_min_piece_bytes: int = constants.HUB_MIN_PIECE_BYTES  # experts are split into pieces no smaller
    hub_connections: int = constants.HUB_CONNECTIONS  # range requests in flight to the Hub at once, at first
    hub_max_connections: int = constants.HUB_MAX_CONNECTIONS  # ... grown to at most (measured; equal: fixed)
    hub_pieces_per_expert: int = constants.HUB_PIECES_PER_EXPERT  # separate requests an expert is split into, at most
    coalesce: bool = True  # demanded experts back to back in a shard fetched as one run of requests


@dataclass
class RemoteConfig:
    """How remote expert execution behaves (household/remote_experts.py); where each expert runs
    is decided by measured costs, not here."""

    deadline_floor_s: float = 1.0  # a call's deadline is at least this ...
    deadline_factor: float = 4.0  # ... and at least this many times its estimated duration
    max_call_bytes: int = constants.RPC_MAX_CALL_ROW_BYTES  # a peer's rows are split into calls no larger
    lan_bandwidth: float = 118e6  # bytes/s a peer's link is assumed to carry until measured (gigabit)


@dataclass
class HouseholdConfig:
    """Joining a household: the shared secret, how peers are found, and what is asked of them."""

    secret: str
    peers: list[str] = field(default_factory=list)  # HOST:PORT of nodes to use besides those found
    discover: bool = False  # advertise this node and find the others with zeroconf
    cluster: str = "home"  # zeroconf: nodes join their own cluster only
    interface: str | None = None  # zeroconf: advertise and browse on this address only
    tls_ca: bytes | None = None  # the household certificate: call peers over TLS
    remote: RemoteConfig | None = field(default_factory=RemoteConfig)  # None: always fetch experts


@dataclass
class RpcConfig:
    """The node's gRPC service (proto/expertmesh/v1/node.proto)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port
    tls_cert: str | None = None  # PEM files of the household certificate (rpc/tls.py)
    tls_key: str | None = None
    max_workers: int = 18  # 4 kept for health and Info, 4 generations, 2 token counts, 8 peer calls (rpc/server.py)


@dataclass
class MetricsConfig:
    """Prometheus `/metrics` of the node.

    `linger_s`: how long `run` keeps `/metrics` up after its generation at most, waiting for one
    scrape of the final counts (observability/metrics.py's `MetricsServer.linger` says why); 0
    stops it at once. `serve` runs until stopped and does not linger.
    """

    host: str = "127.0.0.1"
    port: int = 0  # 0 picks a free port
    linger_s: float = 0.0


# `run --metrics-linger`'s default: three scrape intervals of deploy/prometheus/prometheus.yml (5 s),
# so one failed or late scrape still leaves another; a scrape ends the linger at once.
RUN_METRICS_LINGER_S = 15.0


@dataclass
class ApiConfig:
    """The embedded coordinator's OpenAI-compatible API.

    Beyond loopback it needs an API key (coordinator/api_access.py says why keys of their own):
    the keys are in `key_file`, created with one key if it holds none."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    max_waiting: int = 16  # requests that may wait for a generation slot before the API answers 429
    max_connections: int = 4096  # open at once (at most half the open-file limit); beyond, the oldest idle closes
    allowed_hosts: list[str] = field(default_factory=list)  # more names clients use for this machine (Host header)
    key_file: Path | None = None  # default: `api-keys` in the home


@dataclass
class SpeculationConfig:
    """How to speculate. `mode` is one of SPECULATION_MODES; `draft_repo` names the draft model for "draft"."""

    mode: str = DEFAULT_SPECULATION
    draft_repo: str | None = None
    initial_draft: int = 3  # drafts per verify pass at the start
    max_draft: int = 8
    ngram_max: int = 4  # longest suffix looked up in the context
    ngram_min: int = 2  # shorter suffixes match by chance too often to be worth a pass's width
    min_acceptance: float = 0.3  # below this (smoothed) acceptance rate speculation does not pay
    warmup_rounds: int = 3  # verify rounds before the off-switch may engage
    cooldown_tokens: int = 16  # plain tokens before probing again; doubles while it keeps failing
    max_cooldown_tokens: int = 512

    def __post_init__(self) -> None:
        if self.mode not in SPECULATION_MODES:
            raise SpeculationError(f"--speculate must be one of {', '.join(SPECULATION_MODES)}, not {self.mode!r}")
        if self.mode == "draft" and not self.draft_repo:
            raise SpeculationError("--speculate draft needs --draft REPO (a small mlx-lm model, same tokenizer)")
        if not 1 <= self.initial_draft <= self.max_draft:
            raise SpeculationError(f"draft length must be in 1..{self.max_draft}, not {self.initial_draft}")


# `serve --max-batch`'s default, chosen by benchmarks/bench_batching.py (figures in docs/batching.md):
# 4 rows multiply throughput while each request keeps about half its speed alone, more rows slow each
# request further for little gain, and a household rarely has more than 4 conversations at once.
DEFAULT_MAX_BATCH = 4


PROMPT_EXPERT_MODES = ("exact", "held", "keep", "drop", "topp", "budget")


@dataclass(frozen=True)
class PromptExperts:
    """A prompt's expert mode as `--prompt-experts` names it: exact | held | keep | drop | topp:P | budget:SECONDS."""

    mode: str = "exact"
    value: float = 0.0  # topp's P, budget's seconds

    @classmethod
    def parse(cls, text: str) -> PromptExperts:
        """Raises ValueError naming what is wrong (a 400 over the API, a usage error on the CLI)."""
        name, _, arg = (text or "exact").strip().partition(":")
        if name not in PROMPT_EXPERT_MODES:
            raise ValueError(
                f"prompt experts must be one of exact, held, keep, drop, topp:P, budget:SECONDS, not {text!r}"
            )
        if name in ("topp", "budget"):
            try:
                value = float(arg)
            except ValueError:
                raise ValueError(f"prompt experts {name} needs a number after the colon, not {arg!r}") from None
            if name == "topp" and not 0 < value <= 1:
                raise ValueError(f"prompt experts topp:P needs 0 < P <= 1, not {value}")
            if name == "budget" and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"prompt experts budget:SECONDS needs a non-negative number of seconds, not {value}")
            return cls(name, value)
        if arg:
            raise ValueError(f"prompt experts {name} takes no argument, not {text!r}")
        return cls(name)

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    def __str__(self) -> str:
        return f"{self.mode}:{self.value:g}" if self.mode in ("topp", "budget") else self.mode


@dataclass
class NodeConfig:
    """One node: which model, where its home is, and which of its parts run.

    A node with only `repo_id` is what `run` and `chat` use: the model, its store and its tiers,
    alone. `household` joins other Macs; `rpc` serves them (and needs `household` for the
    secret); `metrics` and `api` serve Prometheus and OpenAI clients. `cache_only` makes a cache
    peer: no core and no MLX, only expert bytes for the household.
    """

    repo_id: str
    revision: str | None = None
    home: Path | None = None  # default: $EXPERTMESH_HOME
    node_id: str | None = None  # default: the one kept in the home
    cache_only: bool = False
    store: StoreConfig = field(default_factory=StoreConfig)
    household: HouseholdConfig | None = None
    rpc: RpcConfig | None = None
    metrics: MetricsConfig | None = None
    api: ApiConfig | None = None
    speculation: SpeculationConfig | None = None  # None or mode "off": no speculation in Generate
    # Generate calls decoded together in one batch (node/engine/batching.py); 1: one at a time, as
    # before batching. A call speculates only while it runs alone. `serve` defaults to DEFAULT_MAX_BATCH.
    max_batch: int = 1
    # tokens a conversation may hold (`--max-context`): the KV cache / linear-attention state the
    # memory plan counts, and the limit generation enforces; at most the model's own context
    max_context: int = constants.DEFAULT_MAX_CONTEXT
    # the core's memory (`--core-budget`: a size, or a % of the core): below the core's size it is
    # streamed from the SSD within it (node/engine/streamed_core.py); None: held whole where it
    # fits, else streamed within what the plan leaves it
    core_budget: str | None = None
    # the states of earlier prompts kept for reuse (`--prefix-cache`, node/engine/prefix_cache.py); "0": none
    prefix_cache: str = constants.DEFAULT_PREFIX_CACHE
    # the disk under the home those of 1,024 tokens or more are kept in across restarts
    # (`--prefix-disk-budget`, node/engine/prefix_disk.py; least recently used go first); "0": none
    prefix_disk_budget: str = constants.DEFAULT_PREFIX_DISK_BUDGET
    # which experts a prompt's rows use when a Generate call does not say (`--prompt-experts`,
    # node/engine/prompt_experts.py): exact by default; decoding is always exact
    prompt_experts: str = "exact"
