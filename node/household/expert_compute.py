"""The serving side of remote expert execution: run held experts on rows another node sent.

A peer that holds an expert computes it with the same block (`StreamingExperts.compute_rows`,
the same kernels and precision the requester would use) on the rows that arrived, so a remotely
computed expert gives the requester what its own computation would have given. Only experts
this node holds in RAM or on disk run unless the caller asks as the owner (`fetch_on_miss`); the
rest are reported missing so the caller fetches them itself, never silently dropped. What a caller
asks for as the owner is kept on disk as this node's own (`DiskCache.claim`), even where this
node's peer table names another owner: the caller counts it as held here from then on.

A call is served in two halves per group of experts: on the gRPC thread that received it, the
request is checked and the experts are got from the store's one entry point (`layer_groups`,
in groups within its hold limit: it may wait on a disk or the Hub, and involves no MLX); then
each group's placing (in RAM-tier slots, or as decoded where the tier does not keep an expert),
the compute and the encoded outputs are handed to the MLX thread as a peer's call
(node/engine/model_thread.py), which takes its turn beside this node's own generation.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from expertmesh.node.engine.blocks import StreamingExperts
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.engine.streamed_model import StreamedModel
from expertmesh.node.errors import DownloadError
from expertmesh.node.rpc import activations
from expertmesh.node.store.store import ExpertGroup
from expertmesh.v1 import node_pb2

MAX_ROWS_PER_CALL = 1 << 16  # prefill of thousands of tokens times k experts fits; more is a bad caller


class ComputeRequestError(ValueError):
    """A ComputeExperts request that names what does not exist or carries malformed rows."""


def expand_shared_rows(request: node_pb2.ComputeExpertsRequest, width: int) -> None:
    """Give each expert of a request with shared rows (`rows` once, `row_index` per expert) its own
    rows, in place, on the host: the rest of the path then reads a call as older callers send it.

    Raises:
        ComputeRequestError: shared rows of the wrong shape or dtype, an expert with rows of its
            own as well or with none, an index past the shared rows, or more rows than a call may hold.
    """
    shared = request.rows
    try:
        activations.check(shared, width)
    except activations.BadTensor as e:
        raise ComputeRequestError(f"shared rows: {e}") from None
    n = shared.shape[0]
    total = sum(len(item.row_index) for item in request.experts)
    if total > MAX_ROWS_PER_CALL:  # before any copy: each index makes a row
        raise ComputeRequestError(f"{total} rows in one call; at most {MAX_ROWS_PER_CALL}")
    for item in request.experts:
        if item.HasField("rows") or not item.row_index:
            raise ComputeRequestError(f"expert {item.expert}: with shared rows, name its rows by row_index only")
        last = max(item.row_index)
        if last >= n:
            raise ComputeRequestError(f"expert {item.expert}: row index {last} past the {n} shared rows")
        item.rows.CopyFrom(activations.take_rows(shared, item.row_index))
        del item.row_index[:]
    request.ClearField("rows")


@dataclass
class ComputeResult:
    outputs: list[node_pb2.ExpertRows]
    missing: list[int]
    seconds: float
    queued: int
    mlx_wait_seconds: float = 0.0  # the part of `seconds` spent waiting for the MLX thread


class ExpertComputer:
    """Computes a layer's held experts for peers, with the node's own blocks and expert store."""

    def __init__(self, sm: StreamedModel):
        self.sm = sm
        self.blocks: dict[int, StreamingExperts] = {b.layer: b for b in sm.blocks}
        self._running = 0
        self._lock = threading.Lock()

    def check(self, request: node_pb2.ComputeExpertsRequest) -> StreamingExperts:
        """The layer's block, once every part of the request is checked (no MLX: any thread).

        Raises:
            ComputeRequestError: unknown layer or expert, an expert twice, too many rows, or rows
                of the wrong width, dtype or length.
        """
        block = self.blocks.get(request.layer)
        if block is None:
            raise ComputeRequestError(f"layer {request.layer} has no routed experts in {self.sm.repo_id}")
        if not request.experts:
            raise ComputeRequestError("no experts to compute")
        if request.HasField("rows"):
            expand_shared_rows(request, block.input_width)
        seen: set[int] = set()
        total, dtype = 0, request.experts[0].rows.dtype  # one pass, one dtype
        for item in request.experts:
            if (request.layer, item.expert) not in self.sm.index.experts:
                raise ComputeRequestError(f"{self.sm.repo_id} has no expert {item.expert} in layer {request.layer}")
            if item.expert in seen:
                raise ComputeRequestError(f"expert {item.expert} is listed twice")
            seen.add(item.expert)
            try:
                activations.check(item.rows, block.input_width, dtype=dtype)
            except activations.BadTensor as e:
                raise ComputeRequestError(f"rows of expert {item.expert}: {e}") from None
            total += item.rows.shape[0]
        if total > MAX_ROWS_PER_CALL:
            raise ComputeRequestError(f"{total} rows in one call; at most {MAX_ROWS_PER_CALL}")
        return block

    def compute(self, request: node_pb2.ComputeExpertsRequest) -> ComputeResult:
        """Run what the request asks, as far as this node holds it (or fetches it, as the owner).

        Raises:
            ComputeRequestError: see `check`.
            DownloadError: an expert this node had to fetch could not be had.
        """
        block = self.check(request)
        with self._lock:
            queued = self._running
            self._running += 1
        try:
            t0 = time.perf_counter()
            store, layer = self.sm.store, request.layer
            if request.fetch_on_miss:
                here = [x.expert for x in request.experts]
                for e in here:  # the caller counts them as held here from now on: kept as an owner's
                    self.sm.disk.claim((layer, e))
            else:
                here = [
                    x.expert
                    for x in request.experts
                    if (layer, x.expert) in store.ram or (layer, x.expert) in self.sm.disk
                ]
            missing = [x.expert for x in request.experts if x.expert not in here]
            outputs: list[node_pb2.ExpertRows] = []
            waited = 0.0
            rows = {x.expert: x.rows for x in request.experts}
            # bytes and buffers only on this thread; not this node's own pass of the layer
            for group in store.layer_groups(layer, here, routed=[]) if here else ():
                asked = time.perf_counter()
                started, done = model_thread().call_for_peer(_run, block, group, rows)
                waited += started - asked
                outputs += done
            return ComputeResult(outputs, missing, time.perf_counter() - t0, queued, waited)
        finally:
            with self._lock:
                self._running -= 1

    def recompute(self, layer: int, expert: int, rows: node_pb2.Tensor) -> node_pb2.Tensor:
        """`expert` of `layer` on `rows` here, as a peer's call is served, fetched through the store
        where this node does not hold it (no claim: it is no owner's duty): what a compute peer's
        answer is checked against (household/compute_audit.py).

        Raises:
            ComputeRequestError: an unknown layer or expert, or malformed rows.
            DownloadError: the expert could not be had.
        """
        request = node_pb2.ComputeExpertsRequest(layer=layer, experts=[node_pb2.ExpertRows(expert=expert, rows=rows)])
        block = self.check(request)
        done: list[node_pb2.ExpertRows] = []
        for group in self.sm.store.layer_groups(layer, [expert], routed=[]):
            done += model_thread().call_for_peer(_run, block, group, {expert: rows})[1]
        if not done:
            raise DownloadError(f"expert {expert} of layer {layer} could not be had to compute")
        return done[0].rows


def _run(
    block: StreamingExperts, group: ExpertGroup, rows: dict[int, node_pb2.Tensor]
) -> tuple[float, list[node_pb2.ExpertRows]]:
    """On the MLX thread: the group placed, the rows into MLX, through the experts, and back
    into messages; with when it started.

    Outputs go back in the dtype the rows came in, which is what the requester checks
    (household/remote_experts.py): an expert held in another precision than the caller's
    activations (a node that runs BF16 experts in float32 on a CPU, asked by a BF16 one)
    would otherwise answer in its own dtype and every answer would be refused as malformed."""
    started = time.perf_counter()
    with group.placed() as placed:
        # the request's order
        x = {e: activations.decode(rows[e], block.input_width) for e in rows if e in group.served}
        out = {e: y.astype(x[e].dtype) for e, y in block.compute_rows(placed, x).items()}
        mx.eval(list(out.values()))  # while the slots are pinned
    return started, [node_pb2.ExpertRows(expert=e, rows=activations.encode(out[e])) for e in rows if e in out]
