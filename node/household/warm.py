"""`expertmesh warm`: an idle household fills its disks with the experts each node owns.

Every expert has one owner (node/household/peers_tier.py: weighted rendezvous over disk budgets). Warming asks
each owner to keep its experts — FetchExpert with `keep_only`, so the owner fetches a missing
expert from the Hub once and no bytes cross the LAN — most used first, into free disk budget
only: a warm never evicts what use has cached, and a node whose budget is full stops being asked.
What an owner already holds (its inventory) is skipped, so a second warm costs no Hub traffic.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import grpc

from expertmesh.node.fetching import hub_fetch_bound_s
from expertmesh.node.household.membership import expert_key, rendezvous_score
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.rpc.admission import is_busy
from expertmesh.node.rpc.client import NodeClient, ask_info, model_key
from expertmesh.node.rpc.inventory import layer_sizes

logger = logging.getLogger(__name__)

ExpertKey = tuple[int, int]
DEFAULT_CONCURRENCY = 4  # keep requests in flight per node: the owner's Hub link, not the LAN, is the limit
GIVE_UP_AFTER_ERRORS = 5  # consecutive failures before a node is left out of this warm
BUSY_RETRIES = 4  # a busy node is asked again after 0.5, 1, 2 and 4 s before it counts as a failure
BUSY_WAIT_S = 0.5


def keep_deadline_s(concurrency: int, nbytes: int) -> float:
    """How long one keep of an expert of `nbytes` may take before warm counts it a failure.

    A keep is one Hub fetch on the owner, which bounds it there (`hub_fetch_bound_s`: a budget,
    and more while bytes keep coming on a slow, full link). With `concurrency` keeps in flight on
    one owner the last may start only when the others end, so its bound is theirs added up. A
    shorter one gives up on a slow link while the owner goes on fetching, and after five such
    keeps warm leaves a healthy owner out.
    """
    return max(1, concurrency) * hub_fetch_bound_s(nbytes)


def warm_order(index: ExpertIndex, uses: Counter | None = None) -> list[ExpertKey]:
    """Every expert, most used first (`uses`, e.g. from routing traces), the rest spread across
    layers (expert 0 of every layer, then expert 1, ...) so a partial warm helps every layer."""
    uses = uses or Counter()
    return sorted(index.experts, key=lambda k: (-uses.get(k, 0), k[1], k[0]))


@dataclass
class NodeWarm:
    """One node's part of a warm."""

    node_id: str
    address: str
    disk_budget_bytes: int
    owned: int = 0  # experts this node owns
    held: int = 0  # already on its disk before this warm
    kept: int = 0  # fetched and kept by this warm
    kept_bytes: int = 0
    full: bool = False  # its budget ran out: the rest of what it owns was not asked for
    unreachable: str = ""  # why it was left out, if it was
    errors: Counter = field(default_factory=Counter)  # grpc status name -> count
    failures_in_a_row: int = field(default=0, repr=False)

    @property
    def left(self) -> int:
        return self.owned - self.held - self.kept


@dataclass
class WarmNode:
    node_id: str
    address: str
    disk_budget_bytes: int


def describe_nodes(
    addresses: Iterable[str], index: ExpertIndex, secret: str, tls_ca: bytes | None = None
) -> tuple[list[WarmNode], list[str]]:
    """The nodes at `addresses` that serve this exact model (repo and commit), and a line for
    each that does not or did not answer."""
    nodes, skipped = [], []
    for answer in ask_info(addresses, secret, tls_ca):
        address, info = answer.address, answer.info
        if info is None:
            skipped.append(f"{address}: {answer.error}")
            continue
        if not any(m.repo_id == index.repo_id and m.commit == index.commit for m in info.models):
            served = ", ".join(f"{m.repo_id}@{m.commit[:12]}" for m in info.models) or "nothing"
            skipped.append(f"{address} ({info.node_id}): serves {served}, not {index.repo_id}@{index.commit[:12]}")
            continue
        if info.disk_budget_bytes == 0:
            skipped.append(f"{address} ({info.node_id}): no disk budget, owns nothing")
            continue
        nodes.append(WarmNode(info.node_id, address, info.disk_budget_bytes))
    return nodes, skipped


def owners(index: ExpertIndex, nodes: list[WarmNode], keys: Iterable[ExpertKey]) -> dict[str, list[ExpertKey]]:
    """node id -> the keys it owns, in the order given (the same rendezvous as the peers tier)."""
    out: dict[str, list[ExpertKey]] = {n.node_id: [] for n in nodes}
    for key in keys:
        k = expert_key(index, *key)
        best = max(nodes, key=lambda n: rendezvous_score(k, n.node_id, n.disk_budget_bytes))
        out[best.node_id].append(key)
    return out


def warm(
    index: ExpertIndex,
    nodes: list[WarmNode],
    secret: str,
    order: list[ExpertKey] | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: Callable[[int, int], None] | None = None,
    stop: threading.Event | None = None,
    tls_ca: bytes | None = None,
) -> list[NodeWarm]:
    """Ask every node to keep the experts it owns, in `order`; returns what each did.

    `progress(done, bytes)` is called after each expert (from several threads); `stop` ends the
    warm early (Ctrl-C): requests in flight finish, nothing else is sent.
    """
    order = order if order is not None else warm_order(index)
    stop = stop or threading.Event()
    model = model_key(index.repo_id, index.commit)
    owned = owners(index, nodes, order)
    results = {
        n.node_id: NodeWarm(n.node_id, n.address, n.disk_budget_bytes, owned=len(owned[n.node_id])) for n in nodes
    }
    lock = threading.Lock()
    counts = [0, 0]

    def deadline_s(key: ExpertKey) -> float:
        return keep_deadline_s(concurrency, index.expert(*key).nbytes)

    def keep(client: NodeClient, key: ExpertKey) -> None:
        """Ask the node to keep `key`; a node that is busy (rpc/admission.py) is asked again a few
        times, waiting longer each time. Raises grpc.RpcError."""
        for attempt in range(BUSY_RETRIES + 1):
            try:
                for _ in client.fetch_expert(model, *key, deadline_s(key), fetch_on_miss=True, keep_only=True):
                    pass
                return
            except grpc.RpcError as e:
                if not is_busy(e) or attempt == BUSY_RETRIES or stop.wait(BUSY_WAIT_S * 2**attempt):
                    raise

    def one(node: NodeWarm, client: NodeClient, key: ExpertKey) -> None:
        if stop.is_set() or node.full or node.unreachable:
            return
        try:
            keep(client, key)
        except grpc.RpcError as e:
            with lock:
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not is_busy(e):
                    node.full = True
                    return
                node.errors[e.code().name.lower()] += 1
                node.failures_in_a_row += 1
                if node.failures_in_a_row >= GIVE_UP_AFTER_ERRORS and not node.unreachable:
                    node.unreachable = (
                        f"{node.failures_in_a_row} failures in a row, the last {e.code().name.lower()}: {e.details()}"
                    )
            return
        nbytes = index.expert(*key).nbytes
        with lock:
            node.failures_in_a_row = 0
            node.kept += 1
            node.kept_bytes += nbytes
            counts[0] += 1
            counts[1] += nbytes
            done = tuple(counts)
        if progress is not None:
            progress(*done)

    clients, queues = [], []
    sizes = layer_sizes(index)
    for n in nodes:
        node = results[n.node_id]
        client = NodeClient(n.address, secret, tls_ca)
        clients.append(client)
        try:
            held = client.inventory(model, sizes)
        except grpc.RpcError as e:
            node.unreachable = f"inventory: {e.code().name.lower()}"
            continue
        todo = [k for k in owned[n.node_id] if k not in held]
        node.held = node.owned - len(todo)
        queues.append([(node, client, key) for key in todo])
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency) * max(1, len(nodes)), thread_name_prefix="warm")
    try:
        # round-robin across nodes, so every node has requests in flight from the start
        futures = [pool.submit(one, *item) for batch in itertools.zip_longest(*queues) for item in batch if item]
        pending = set(futures)
        while pending:
            _, pending = wait(pending, timeout=0.5)  # a short wait, so Ctrl-C reaches this thread
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for client in clients:
            client.close()
    return [results[n.node_id] for n in nodes]
