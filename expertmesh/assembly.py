"""The one place a node is assembled, started and stopped.

`build_node(config)` makes every part from a NodeConfig before any thread starts, in the order
of the trip of an expert:

    index, disk tier, digests       what the pinned model's experts are, and the copies on this disk
    membership                      the household's peer table: who is here, who owns which expert
    tiers                           disk -> peers -> Hub, with the integrity checks between them
    store                           RAM, single-flight demand, prefetch, idle-link fill
    model (a full node)             mlx-lm's model, its expert blocks bound to the store
    remote execution                experts run on the peers that hold them (ComputeExperts)
    served experts                  what peers may fetch from this node
    metrics, gRPC service, API      how the node is watched and reached

`Node.start()` then starts the threads and servers in dependency order (store, peer health
checks, /metrics, gRPC, the zeroconf advertisement, the API) and `Node.close()` stops them in
reverse. `serve`, `run`, `chat`, `demo`, the bench and the tests all go through here.

A full node's MLX work — loading the core, MLX's buffer cache limit and the wired memory set at
start and undone at close, every token and every peer's ComputeExperts — runs on the process's
MLX thread (node/engine/model_thread.py); its memory is planned from the machine before the core
is loaded (node/engine/memory.py), so a core that cannot fit is refused first.
"""

from __future__ import annotations

import logging
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from expertmesh.node import constants
from expertmesh.node.config import ApiConfig, HouseholdConfig, NodeConfig, RpcConfig, StoreConfig
from expertmesh.node.engine.core_replacement import finish_replacement
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.errors import EndpointUnreachableError, ExpertmeshError
from expertmesh.node.hub import local_models
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex
from expertmesh.node.sizes import format_size, parse_budget, parse_size
from expertmesh.node.store.integrity import DIGESTS_FILENAME, DigestBook
from expertmesh.node.store.routing import RoutingRecorder
from expertmesh.node.store.stats import StoreStats
from expertmesh.node.store.tiers import Tier
from expertmesh.node.store.tiers.disk import DiskCache, cache_dir

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import grpc

    from expertmesh.coordinator.openai_api import OpenAIServer
    from expertmesh.node.engine.memory import MemoryPlan
    from expertmesh.node.engine.streamed_model import StreamedModel
    from expertmesh.node.household.discovery import Discovery
    from expertmesh.node.household.membership import PeerTable
    from expertmesh.node.household.peers_tier import PeerSource
    from expertmesh.node.household.remote_experts import RemoteExperts
    from expertmesh.node.hub.client import RangeReader
    from expertmesh.node.observability.metrics import MetricsServer, NodeMetrics
    from expertmesh.node.rpc.server import NodeServer
    from expertmesh.node.service import NodeService
    from expertmesh.node.store.served import ServedExperts
    from expertmesh.node.store.store import ExpertStore
    from expertmesh.node.store.tiers.hub import HubSource

logger = logging.getLogger(__name__)


@dataclass
class Node:
    """A node's parts. A full node has `model` and `store`; a cache peer has neither.

    `peers` is the household's peer table (None alone), `peer_tier` the tier that fetches from
    it (None without peers to ask). Servers are set once `start` has run.
    """

    config: NodeConfig
    node_id: str
    index: ExpertIndex
    disk: DiskCache
    stats: StoreStats
    experts: ServedExperts | None  # what peers fetch from this node
    hub: HubSource
    model: StreamedModel | None = None
    store: ExpertStore | None = None
    peers: PeerTable | None = None
    peer_tier: PeerSource | None = None
    remote: RemoteExperts | None = None
    metrics: NodeMetrics | None = None
    service: NodeService | None = None
    rpc: NodeServer | None = None
    metrics_server: MetricsServer | None = None
    discovery: Discovery | None = None
    api: OpenAIServer | None = None
    memory: MemoryPlan | None = None  # a full node's RAM tier, buffer cache and wiring
    _unwire: Callable[[], None] | None = field(default=None, repr=False)
    _started: bool = field(default=False, repr=False)
    _closed: bool = field(default=False, repr=False)

    @property
    def role(self) -> str:
        return "cache" if self.model is None else "full"

    def require_model(self) -> StreamedModel:
        """The model of a full node.

        Raises:
            ExpertmeshError: this is a cache peer (`cache_only`): it holds experts, not a model.
        """
        if self.model is None:
            raise ExpertmeshError(f"this node is a cache peer for {self.repo_id}: it has no model to generate with")
        return self.model

    @property
    def repo_id(self) -> str:
        return self.index.repo_id

    @property
    def commit(self) -> str:
        return self.index.commit

    def start(self) -> Node:
        """Start threads and servers, each after what it depends on; a failure stops what started."""
        if self._started:
            return self
        self._started = True
        try:
            self.disk.start()
            if self.model is not None:
                self._unwire = model_thread().call(_hold_memory, self.memory)
            if self.store is not None:
                self.store.start()
            self.hub.start()
            if self.peer_tier is not None:
                self.peer_tier.start_health_checks()
            if self.metrics is not None and (m := self.config.metrics) is not None:
                try:
                    self.metrics_server = self.metrics.serve(m.host, m.port)
                except OSError as e:
                    raise ExpertmeshError(f"cannot serve metrics on {m.host}:{m.port}: {e.strerror or e}") from None
            if self.rpc is not None:
                self.rpc.start()
            household, rpc = self.config.household, self.config.rpc
            if household is not None and household.discover and rpc is not None and self.rpc is not None:
                self.discovery = _advertise(self, household, rpc, self.rpc)
            if self.api is not None:
                self.api.start()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop everything started, in reverse order; safe to call twice, and on a half-built node."""
        if self._closed:
            return
        self._closed = True
        stops = []
        if self.api is not None:
            stops.append(self.api.stop)
        if self.discovery is not None:
            stops.append(self.discovery.close)
        if self.rpc is not None:
            stops.append(self.rpc.stop)
        close_service = getattr(self.service, "close", None)
        if close_service is not None:
            stops.append(close_service)  # its batch engine, once no call can reach it
        if self.metrics_server is not None:
            stops.append(self.metrics_server.stop)
        if self.remote is not None and self.remote.audit is not None:
            stops.append(self.remote.audit.stop)  # before the store it fetches through
        if self.store is not None:
            stops.append(self.store.close)  # its fetch workers, then its tiers
        else:
            stops += [tier.close for tier in (self.peer_tier, self.hub) if tier is not None]
        stops.append(self.disk.close)  # last: what was queued is published
        if self.model is not None and self.model.core_stream is not None:
            stops.append(self.model.core_stream.close)
        unwire = self._unwire
        if unwire is not None:
            stops.append(lambda: model_thread().call(unwire))
        for stop in stops:
            try:
                stop()
            except Exception:  # the rest must still stop
                logger.exception("stopping a part of the node failed")

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        """One line: what this node holds and where experts come from."""
        if self.model is None:
            return f"cache peer: experts on disk ({format_size(self.disk.budget_bytes)} at {self.disk.root}), the Hub on a miss"
        core = f"core {format_size(self.model.core_bytes)} in memory"
        if self.memory is not None and self.memory.streamed:
            core = (
                f"core {format_size(self.model.core_bytes)} streamed from the SSD within "
                f"{format_size(self.memory.core_memory_bytes)}"
            )
        return (
            f"{self.repo_id} @ {self.commit[:12]}: {core}; "
            f"experts from RAM ({format_size(self.model.store.ram.budget_bytes)}), "
            f"disk cache ({format_size(self.disk.budget_bytes)} at {self.disk.root}), "
            + ("peers, " if self.peer_tier is not None else "")
            + "then the Hub"
        )


def build_node(
    config: NodeConfig,
    *,
    hub_reader: RangeReader | None = None,
    service_class: type[NodeService] | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> Node:
    """Every part of the node `config` describes, made but not started.

    Args:
        hub_reader: the Hub client (hub/client.py's RangeReader) to use instead of a new one:
            tests inject faults with it, the bench a naive client.
        service_class: the gRPC servicer class (default node/service.py's NodeService); tests
            subclass it to make a peer misbehave.
        interceptors: extra gRPC server interceptors (devtools/link_emulation.py's LAN).

    Raises:
        NotPulledError: the model (or, for a cache peer, its index) is not pulled here.
        UnsupportedModelError: mlx-lm cannot run it, or it has no streamable experts.
        EndpointUnreachableError: a listed peer does not answer.
        ExpertmeshError: the parts asked for do not fit together (e.g. gRPC without a secret).
    """
    from expertmesh.node.household.node_id import load_or_create_node_id
    from expertmesh.node.rpc.proof import valid_node_id
    from expertmesh.node.store.served import ServedExperts
    from expertmesh.node.store.tiers.hub import HubSource

    home = config.home or constants.expertmesh_home()
    if config.rpc is not None and config.household is None:
        raise ExpertmeshError("serving gRPC needs a household secret (HouseholdConfig)")
    if config.cache_only and (config.api is not None and config.rpc is None):
        raise ExpertmeshError("a cache peer serves expert bytes only: it needs gRPC")
    if config.api is not None and config.rpc is None:
        raise ExpertmeshError("the HTTP API reaches this node's model over gRPC: it needs gRPC (RpcConfig)")
    # a node alone needs no identity (and writes none: `run` on a full or read-only home still runs)
    node_id = config.node_id or (load_or_create_node_id(home) if config.household is not None else "local")
    if config.household is not None and not valid_node_id(node_id):  # peers refuse it in every proof
        raise ExpertmeshError(
            f"the node id {node_id[:80]!r} cannot join a household: use 1 to 64 of the letters, digits, '.', '_' and '-'"
        )
    if config.cache_only:
        path = local_models.find_index(home, config.repo_id, config.revision)
    else:
        path = local_models.find_pulled(home, config.repo_id, config.revision)
        finish_replacement(path)  # a quantisation a crash cut short is completed before anything reads the core
    index = ExpertIndex.load(path / INDEX_FILENAME)

    root = cache_dir(home, config.repo_id, index.commit)
    memory = None if config.cache_only else plan_node_memory(config, index, home)  # refused before loading
    ram_bytes = memory.ram_tier_bytes if memory is not None else 0
    disk_bytes = disk_budget(config.store, root)
    digests = DigestBook(root / DIGESTS_FILENAME)
    disk = DiskCache(root, index, disk_bytes, digests)
    stats = StoreStats()
    s = config.store
    hub = HubSource(
        index,
        hub_reader,
        connections=s.hub_connections,
        pieces_per_expert=s.hub_pieces_per_expert,
        min_piece_bytes=s.hub_min_piece_bytes,
        max_connections=max(s.hub_connections, s.hub_max_connections),
    )
    node = Node(config, node_id, index, disk, stats, experts=None, hub=hub, memory=memory)
    try:
        if config.household is not None:
            _join_household(node, config.household)
        remote_tiers: list[Tier] = [t for t in (node.peer_tier, hub) if t is not None]
        experts = node.experts = ServedExperts(
            index.repo_id,
            index.commit,
            index,
            disk,
            digests,
            remote_tiers,
            stats,
            ram_budget_bytes=ram_bytes if not config.cache_only else 0,
            received_bytes=_received_bytes(hub, node.peer_tier),
        )
        if not config.cache_only:
            _build_model(node, path, ram_bytes, remote_tiers, digests)
        if config.metrics is not None:
            _build_metrics(node)
        if config.rpc is not None and config.household is not None:  # (checked above: gRPC needs a household)
            _build_rpc(node, config.rpc, config.household, experts, service_class, interceptors)
            if config.api is not None:
                _build_api(node, config.api, config.rpc, config.household)
    except BaseException:
        node.close()
        raise
    return node


def open_model(
    repo_id: str,
    *,
    home: Path | None = None,
    revision: str | None = None,
    store: StoreConfig | None = None,
    hub_reader: RangeReader | None = None,
) -> StreamedModel:
    """A started node with nothing but its model: what `run`, the bench and most tests use.
    Closing the model (`StreamedModel.close`) closes the node."""
    node = build_node(NodeConfig(repo_id, revision, home=home, store=store or StoreConfig()), hub_reader=hub_reader)
    return node.start().require_model()


# -- the parts ------------------------------------------------------------------------------


def plan_node_memory(config: NodeConfig, index: ExpertIndex, home: Path) -> MemoryPlan:
    """A full node's memory from this machine (node/engine/memory.py): the core as pulled (held
    whole, or streamed), the context at `config.max_context`, the RAM tier, the buffers — the plan
    `doctor --plan` prints for the same model (node/doctor.py), and in a household what the node
    holds for its peers (node/household/planned_memory.py), which a lone node's plan has not.

    Raises:
        CoreTooLargeError: the core does not fit, not even streamed.
        ValueError: a `ram_budget` or `core_budget` that is neither a size nor a percentage.
    """
    from expertmesh.node.doctor import plan_model

    planned = plan_model(
        home,
        config.repo_id,
        revision=index.commit,
        max_context=config.max_context,
        ram_budget=config.store.ram_budget,
        core_budget=config.core_budget,
        fetch_workers=config.store.fetch_concurrency,
        prefix_cache=config.prefix_cache,
    )
    household = config.household
    if household is not None and (household.peers or household.discover):
        from expertmesh.node.household.planned_memory import household_buffer_bytes

        expert_bytes = max((loc.nbytes for loc in index.experts.values()), default=0)
        planned.planner.household_bytes = household_buffer_bytes(household, expert_bytes)
    return planned.planner.plan()


def disk_budget(cfg: StoreConfig, cache_root: Path) -> int:
    """The disk tier's bytes: a size, or a percentage of the free space where the cache lives."""
    cache_root.mkdir(parents=True, exist_ok=True)
    return parse_budget(cfg.disk_budget, shutil.disk_usage(cache_root).free)


def _hold_memory(plan: MemoryPlan) -> Callable[[], None] | None:
    """On the MLX thread at start: MLX's buffer cache within the RAM budget, and the core plus the
    RAM tier wired where Metal allows. Returns what undoes the wiring at close."""
    from expertmesh.node.engine.memory import limit_buffer_cache, wire

    limit_buffer_cache(plan)
    return wire(plan)


def _join_household(node: Node, household: HouseholdConfig) -> None:
    """The peer table with the listed peers (asked who they are now), and the tier that uses it."""
    import grpc

    from expertmesh.node.household.membership import ExpertOwnership, PeerTable, describe_peer

    node.peers = PeerTable(self_id=node.node_id, self_weight=float(node.disk.budget_bytes))
    node.disk.ownership = ExpertOwnership(node.peers, node.index)  # others' experts leave the disk first
    for address in household.peers:
        try:
            node.peers.add(describe_peer(address, household.secret, household.tls_ca))
        except grpc.RpcError as e:
            raise EndpointUnreachableError(
                f"peer {address} did not answer Prove ({e.code().name.lower()}): "
                "is it running, and is the household secret the same?"
            ) from None
    if (household.peers or household.discover) and not node.config.cache_only:
        # a cache peer follows the household (for the API's view) but fetches from the Hub only
        from expertmesh.node.household.peers_tier import PeerSource

        node.peer_tier = PeerSource(node.index, node.peers, household.secret, tls_ca=household.tls_ca)


def _received_bytes(hub: HubSource, peer_tier: PeerSource | None) -> Callable[[], int]:
    """What this node's remote tiers have received, together: the progress its owner fetches
    show the peers waiting on them (rpc/fetch_progress.py)."""
    if peer_tier is None:
        return hub.reader.received_bytes
    return lambda: hub.reader.received_bytes() + peer_tier.received_bytes()


def _build_model(node: Node, path: Path, ram_bytes: int, remote_tiers: list[Tier], digests: DigestBook) -> None:
    """The core in memory, the store over the tiers, and the expert blocks bound to it."""
    from expertmesh.node.engine.memory import device_memory
    from expertmesh.node.engine.streamed_model import load_streamed_model
    from expertmesh.node.household.warm import warm_order
    from expertmesh.node.store.store import ExpertStore
    from expertmesh.node.store.tier_chain import TierChain
    from expertmesh.node.store.tiers.ram import RamCache

    config, index = node.config, node.index
    s = config.store
    plan = node.memory
    budget = plan.core_held_bytes if plan is not None and plan.streamed else None
    core = model_thread().call(  # evaluated where it runs
        load_streamed_model, config.repo_id, path, index, core_budget_bytes=budget, context_limit=config.max_context
    )
    runs = node.hub if node.peer_tier is None else None  # runs only where nothing is asked between disk and Hub
    chain = TierChain(index, core.codec, node.disk, remote_tiers, node.stats, digests, runs=runs)
    trace: RoutingRecorder | None = None
    if s.trace_path is not None:
        from expertmesh.node.observability.routing_trace import TraceWriter

        trace = TraceWriter(s.trace_path, index)
    owns = None
    if node.peers is not None:
        from expertmesh.node.household.membership import expert_key

        table = node.peers
        owns = lambda key: table.ranked(expert_key(index, *key))[0] is None  # noqa: E731 - only the owner fills
    # one spare slot per fetch worker: experts in use beyond what the budget keeps; no stack larger
    # than the device's largest buffer (Metal's max_buffer_length)
    ram = RamCache.for_model(
        ram_bytes,
        index,
        core.codec,
        s.ram_policy,
        spare_slots=s.fetch_concurrency,
        max_stack_bytes=device_memory().max_buffer_bytes,
    )
    node.store = ExpertStore(
        index,
        ram,
        chain,
        workers=s.fetch_concurrency,
        prefetch=s.prefetch,
        fill_order=warm_order(index) if s.fill else None,
        owns=owns,
        coalesce=s.coalesce,
        trace=trace,
        wait=model_thread().wait,  # a token waiting for experts lets peers' calls run meanwhile
        audit=s.audit,
    )
    node.model = core.bind(node.store, node.disk, close=node.close)
    if node.peer_tier is not None:  # an approximate prompt counts what peers hold as held
        node.model.household_holds = node.peer_tier.held_keys
    remote = config.household.remote if config.household is not None else None
    if node.peer_tier is not None and remote is not None:
        from expertmesh.node.household.remote_experts import RemoteExperts

        node.remote = RemoteExperts(node.store, node.peer_tier, node.disk, remote)
        if s.audit:  # what peers compute is sampled as what they send is (household/compute_audit.py)
            from expertmesh.node.household.compute_audit import ComputeAudit
            from expertmesh.node.household.expert_compute import ExpertComputer

            node.remote.audit = ComputeAudit(
                ExpertComputer(node.model), node.store.flights, node.peer_tier.distrust_peer, node.stats
            )
        for block in node.model.blocks:
            block.bind_remote(node.remote)


def _build_metrics(node: Node) -> None:
    from expertmesh.node.observability.metrics import MetricsSources, NodeMetrics

    ram = node.store.ram if node.store is not None else None
    core = node.model.core_stream if node.model is not None else None
    node.metrics = NodeMetrics(MetricsSources(node.stats, ram, node.disk, node.peers, [node.hub.reader], core))
    node.stats.observer = node.metrics.observe_fetch
    if node.model is not None:
        node.model.token_observer = node.metrics


def _build_rpc(
    node: Node,
    rpc: RpcConfig,
    household: HouseholdConfig,
    experts: ServedExperts,
    service_class: type[NodeService] | None,
    interceptors: Sequence[grpc.ServerInterceptor],
) -> None:
    from expertmesh.node.engine.prompt_experts import PromptExperts
    from expertmesh.node.rpc.server import NodeServer
    from expertmesh.node.service import NodeService

    tls = None
    if rpc.tls_cert or rpc.tls_key:
        from expertmesh.node.rpc.tls import TlsConfigError, server_credentials

        if not (rpc.tls_cert and rpc.tls_key):
            raise TlsConfigError("TLS needs both --tls-cert and --tls-key")
        tls = server_credentials(rpc.tls_cert, rpc.tls_key)
    speculation = node.config.speculation if node.model is not None else None
    service = node.service = (service_class or NodeService)(
        node.model,
        node.node_id,
        experts,
        peers=node.peers,
        speculation=speculation,
        max_batch=node.config.max_batch,
        prefix_cache_bytes=parse_budget(node.config.prefix_cache, 0),
        prefix_dir=(node.config.home or constants.expertmesh_home()) / "prefixes",
        prefix_disk_bytes=parse_size(node.config.prefix_disk_budget),
    )
    service.prompt_experts = PromptExperts.parse(node.config.prompt_experts)
    try:
        server = node.rpc = NodeServer(
            service,
            household.secret,
            host=rpc.host,
            port=rpc.port,
            tls=tls,
            max_workers=rpc.max_workers,
            interceptors=interceptors,
        )
    except OSError as e:
        raise ExpertmeshError(f"cannot serve gRPC on {rpc.host}:{rpc.port}: {e}") from None
    from expertmesh.node.rpc.proof import Prover

    advertised = [h for h in (household.interface, rpc.host) if h and h not in ("0.0.0.0", "::", "")]
    service.prover = Prover(household.secret, server.port, advertised)  # answers Prove for peers


def _build_api(node: Node, api: ApiConfig, rpc: RpcConfig, household: HouseholdConfig) -> None:
    """The embedded coordinator: this node if it is a full node, and the full nodes the peer table follows.

    Beyond loopback the API needs keys: the home's key file gets one if it holds none. The
    open-file limit is raised first, so thousands of idle connections fit beside gRPC."""
    from expertmesh.coordinator.api_access import AccessPolicy, KeyRing, api_keys_path, ensure_api_key, is_loopback
    from expertmesh.coordinator.http_server import ServerLimits
    from expertmesh.coordinator.node_pool import NodePool
    from expertmesh.coordinator.open_files import raise_open_file_limit
    from expertmesh.coordinator.openai_api import Coordinator, CoordinatorConfig, OpenAIServer

    key_file = api.key_file or api_keys_path(node.config.home or constants.expertmesh_home())
    try:
        if not is_loopback(api.host) and ensure_api_key(key_file):
            logger.info("created an API key for clients of the HTTP API in %s", key_file)
        access = AccessPolicy(api.host, KeyRing(key_file), api.allowed_hosts)
    except (OSError, ValueError) as e:
        raise ExpertmeshError(
            f"cannot set up the HTTP API's keys in {key_file}: {getattr(e, 'strerror', None) or e}"
        ) from None
    raise_open_file_limit()
    host = "127.0.0.1" if rpc.host in ("0.0.0.0", "") else rpc.host
    local = [] if node.model is None or node.rpc is None else [f"{host}:{node.rpc.port}"]
    pool = NodePool.following(local, node.peers) if node.peers is not None else NodePool(local)
    repo_id = node.repo_id
    coordinator = Coordinator(
        CoordinatorConfig(
            secret=household.secret,
            models=lambda: [repo_id],
            tls_ca=household.tls_ca,
            max_waiting=api.max_waiting,
            # what this node's Generate really runs at once: 1 where mlx-lm cannot batch the model
            # (more would be refused there and answered 429 instead of waiting in the API's queue)
            generations_per_node=_generations_at_once(node),
        ),
        pool,
    )
    try:
        limits = ServerLimits(max_connections=api.max_connections)
        node.api = OpenAIServer(coordinator, api.host, api.port, access=access, limits=limits)
    except OSError as e:
        raise ExpertmeshError(f"cannot serve the HTTP API on {api.host}:{api.port}: {e.strerror or e}") from None
    if node.metrics is not None:
        # the API's counts on the node's /metrics too: the port that is advertised and scraped
        node.metrics.registry.register(coordinator.metrics)


def _generations_at_once(node: Node) -> int:
    """Generate calls the API may send this node at once: its service's running slots when it
    generates itself, else the configured batch (a coordinator of other nodes only)."""
    service = node.service
    if node.model is not None and service is not None:
        return service.generation_slots.running
    return max(1, node.config.max_batch)


def _advertise(node: Node, household: HouseholdConfig, rpc: RpcConfig, server: NodeServer) -> Discovery:
    """Advertise this node over zeroconf and follow the others into the peer table."""
    from expertmesh.node.household.discovery import Advertisement, Discovery

    address = household.interface or (rpc.host if rpc.host not in ("0.0.0.0", "") else lan_address())
    ad = Advertisement(
        node.node_id,
        household.cluster,
        node.role,
        server.port,
        node.disk.budget_bytes,
        metrics_port=node.metrics_server.port if node.metrics_server is not None else 0,
        compute=node.model is not None,
    )
    interfaces = [household.interface] if household.interface else None
    if node.peers is None:  # made with the household (`_join_household`)
        raise ExpertmeshError("a node that advertises itself needs the household's peer table")
    return Discovery(node.peers, ad, address, interfaces, secret=household.secret, tls_ca=household.tls_ca)


def lan_address() -> str:
    """This machine's address on the default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only selects the interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
