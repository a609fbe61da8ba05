"""The serving side of remote expert execution: run held experts on rows another node sent.

A peer that holds an expert computes it with the same block (`StreamingSwitchGLU.compute`, the
same kernels and precision the requester would use) on the rows that arrived, so a remotely
computed expert gives the requester what its own computation would have given. Only experts
this node holds in RAM or on disk run unless the caller asks as the owner (`fetch_on_miss`); the
rest are reported missing so the caller fetches them itself, never silently dropped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from expertmesh.node.engine.blocks import StreamingSwitchGLU
from expertmesh.node.engine.streamed_model import StreamedModel
from expertmesh.node.rpc import activations
from expertmesh.v1 import node_pb2

MAX_ROWS_PER_CALL = 1 << 16  # prefill of thousands of tokens times k experts fits; more is a bad caller


class ComputeRequestError(ValueError):
    """A ComputeExperts request that names what does not exist or carries malformed rows."""


@dataclass
class ComputeResult:
    outputs: list[node_pb2.ExpertRows]
    missing: list[int]
    seconds: float
    queued: int


class ExpertComputer:
    """Computes a layer's held experts for peers, with the node's own blocks and expert store."""

    def __init__(self, sm: StreamedModel):
        self.sm = sm
        self.blocks: dict[int, StreamingSwitchGLU] = {b.layer: b for b in sm.blocks}
        self._running = 0
        self._lock = threading.Lock()

    def parse(self, request: node_pb2.ComputeExpertsRequest) -> tuple[StreamingSwitchGLU, dict[int, mx.array]]:
        """The layer's block and each expert's input rows, all checked.

        Raises:
            ComputeRequestError: unknown layer or expert, an expert twice, too many rows, or rows
                of the wrong width, dtype or length.
        """
        block = self.blocks.get(request.layer)
        if block is None:
            raise ComputeRequestError(f"layer {request.layer} has no routed experts in {self.sm.repo_id}")
        if not request.experts:
            raise ComputeRequestError("no experts to compute")
        rows: dict[int, mx.array] = {}
        total, dtype = 0, None
        for item in request.experts:
            if (request.layer, item.expert) not in self.sm.index.experts:
                raise ComputeRequestError(f"{self.sm.repo_id} has no expert {item.expert} in layer {request.layer}")
            if item.expert in rows:
                raise ComputeRequestError(f"expert {item.expert} is listed twice")
            dtype = dtype or item.rows.dtype  # one pass, one dtype
            try:
                rows[item.expert] = activations.decode(item.rows, block.input_width, dtype=dtype)
            except activations.BadTensor as e:
                raise ComputeRequestError(f"rows of expert {item.expert}: {e}") from None
            total += rows[item.expert].shape[0]
        if total > MAX_ROWS_PER_CALL:
            raise ComputeRequestError(f"{total} rows in one call; at most {MAX_ROWS_PER_CALL}")
        return block, rows

    def compute(self, request: node_pb2.ComputeExpertsRequest) -> ComputeResult:
        """Run what the request asks, as far as this node holds it (or fetches it, as the owner).

        Raises:
            ComputeRequestError: see `parse`.
            DownloadError: an expert this node had to fetch could not be had.
        """
        block, rows = self.parse(request)
        with self._lock:
            queued = self._running
            self._running += 1
        try:
            t0 = time.perf_counter()
            store, layer = self.sm.store, request.layer
            if request.fetch_on_miss:
                here = list(rows)
            else:
                here = [e for e in rows if (layer, e) in store.ram or (layer, e) in self.sm.disk]
            missing = [e for e in rows if e not in here]
            outputs: list[node_pb2.ExpertRows] = []
            if here:
                out = block.compute(store.get_layer(layer, here, record=False), {e: rows[e] for e in here})
                mx.eval(list(out.values()))
                outputs = [node_pb2.ExpertRows(expert=e, rows=activations.encode(out[e])) for e in here]
            return ComputeResult(outputs, missing, time.perf_counter() - t0, queued)
        finally:
            with self._lock:
                self._running -= 1
