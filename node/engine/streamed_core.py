"""A core larger than memory, streamed from the local SSD layer by layer: slow, never refused.

When the memory plan (node/engine/memory.py) finds that a core does not fit beside the context
and the fetch buffers, `run` still runs it, as the reference system ran K3's 53 GB core on a 64 GB
Mac: the core is loaded lazily (MLX reads a tensor only when it is evaluated), and

    kept        the parameters outside the decoder layers (embeddings, final norm, output head)
                and every layer's router with the MoE module's own routing vectors: the next
                layer's router is applied while this layer computes (expert prefetch guesses);
    pinned      as many of the first layers as the core budget holds beside the layers in
                flight: a pinned byte is never read again, and with layers read in order every
                token a fixed set is the best any cache could keep;
    streamed    every other layer, read from its files when the token reaches it and dropped once
                the layer is computed; `ahead` (1 or 2) layers are being read while one computes,
                so the SSD works on layer l+1 while layer l computes, wrapping around to the next
                token's first streamed layers.

Reads are shaped like the disk tier's (node/store/disk_reads.py): each tensor is cut into pieces
read at once by positional `os.preadv` (which releases the interpreter lock) on a pool of threads,
into a buffer lent by a pool of its own (node/store/buffers.py), and made into an MLX array there
(a copy from the buffer, no graph: nothing to evaluate off the MLX thread). A layer's tensors are
read one after another, so a layer in flight holds its arrays so far and one tensor's buffer. The page cache is told
to forget what was read (`posix_fadvise(DONTNEED)`, macOS's `F_NOCACHE`): a core that does not fit
in memory would only push out what does.

Which bytes make a parameter is learnt from mlx-lm's own `sanitize`, as for experts
(node/model/expert_trace.py): a parameter sanitize leaves as it is stored is read as it is; one it
makes from stored tensors (K3's fused q/k/v, a shifted norm) is read as those tensors and made by
its recipe, in numpy; one it cannot say how it made stays kept. So a core streams in whatever
layout it was pulled, its upstream one or the quantised one `pull --core-bits` writes.

Each streamed layer is its mlx-lm module with one change (its class is swapped for a subclass
whose call installs the layer's arrays first and evaluates what the layer made after, so that
nothing lazy still needs them when they go). That evaluation is one synchronisation per layer a
resident core does not have: the price of not holding the weights, paid only when streaming.
A layer that caches an `mx.compile`d closure of itself (K3's KDA decode step on Metal) has it
dropped after each call: a compiled closure keeps the arrays it captured. Everything MLX runs on
the MLX thread (node/engine/model_thread.py); a layer waits for its reads with the thread's
`wait`, so peers' calls run meanwhile. Tokens are the resident core's, bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import sys
import threading
import time
import types
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from expertmesh.node.engine.blocks import StreamingExperts
from expertmesh.node.engine.core_quantization import is_router
from expertmesh.node.engine.memory import CoreLayout, StreamSplit, stream_split
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.errors import DamagedModelError, UnsupportedModelError
from expertmesh.node.model import expert_trace, safetensors_format
from expertmesh.node.model.codec import read_host, to_mx
from expertmesh.node.model.mlx_lm_models import flat_parameters, layer_number
from expertmesh.node.store.buffers import BufferPool
from expertmesh.node.store.disk_reads import pieces

READ_THREADS = 8  # preadv calls in flight: what an SSD needs queued to reach its speed
PIECE_BYTES = 4 * 1024 * 1024  # one read at most: a large tensor is many reads in flight
_F_NOCACHE = getattr(fcntl, "F_NOCACHE", 48)  # macOS
_COMPILED = type(mx.compile(lambda x: x))
_NP = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "U32": np.uint32, "I32": np.int32,
       "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "U64": np.uint64, "I64": np.int64,
       "BOOL": np.bool_, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "F8_E8M0": np.uint8}  # fmt: skip


@dataclass(frozen=True)
class _Tensor:
    """A stored tensor: which file, where, what."""

    fd_index: int
    start: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass
class _Param:
    """One parameter of a streamed layer: the tensors it is made of and how."""

    rel: str  # its path inside the layer's module
    inputs: list[_Tensor]
    recipe: dict | None  # None: the one input is the parameter as stored
    dtype: mx.Dtype  # what the model computes with (a CPU may widen BF16 to float32)


@dataclass
class _Layer:
    number: int
    module: nn.Module
    params: list[_Param]
    parked: list[tuple[str, mx.array]]  # the lazy, never evaluated arrays the module holds between calls
    nbytes: int  # what the layer's arrays take when held
    read_bytes: int  # what reading it takes from the disk
    future: Future[dict[str, mx.array]] | None = None  # its arrays being read
    pinned: bool = False


@dataclass
class CoreStreamStats:
    """What streaming the core cost: bytes read, layers read, seconds the MLX thread waited."""

    read_bytes: int = 0
    layers_read: int = 0
    wait_s: float = 0.0
    peak_held_bytes: int = 0  # kept + pinned + streamed layers held or in flight, at most
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class StreamedCore:
    """The streaming of one model's core (see the module's docstring); made by `stream_core`."""

    def __init__(self, layers: dict[int, _Layer], order: list[int], files: list[Path], layout: CoreLayout,
                 split: StreamSplit, budget_bytes: int, threads: int = READ_THREADS):  # fmt: skip
        self.layers, self.order, self.layout, self.split = layers, order, layout, split
        self.budget_bytes = budget_bytes
        self.stats = CoreStreamStats()
        self._fds = [_open(p) for p in files]
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="core-read")
        # one reader per layer in flight, each one tensor at a time: what memory the reads take is bounded
        self._layer_pool = ThreadPoolExecutor(1 + split.ahead, thread_name_prefix="core-layer")
        self._buffers = BufferPool(max_idle_buffers=1 + split.ahead)
        self._held = layout.resident_bytes  # bytes of core arrays this object holds or reads now
        self._lock = threading.Lock()
        self._closed = False
        for n in order[: split.pinned]:  # read once by `stream_core`, kept for good
            layers[n].pinned = True
        self._streamed = order[split.pinned :]  # read ahead of each other, wrapping past the pinned ones

    # -- on the MLX thread, around each streamed layer's call ------------------------------------

    def enter(self, number: int) -> None:
        """Before layer `number` computes: its arrays installed (waiting for their reads), the next
        layers' reads started."""
        layer = self.layers[number]
        future = layer.future if layer.future is not None else self._start(layer)
        if not future.done():
            t0 = time.perf_counter()
            model_thread().wait([future])
            self.stats.wait_s += time.perf_counter() - t0
        try:
            arrays = self.install(layer, future.result())
        except OSError as e:  # a core file cut or unreadable since it was loaded
            layer.future = None
            with self._lock:
                self._held -= layer.nbytes
            raise DamagedModelError(
                f"layer {number} of the streamed core cannot be read ({e}): `expertmesh pull` repairs the model"
            ) from None
        layer.future = None
        layer.module.update(tree_unflatten(list(arrays.items())))
        self._read_ahead(number)

    def leave(self, number: int, made: object) -> None:
        """After layer `number` computed: what it made evaluated, its arrays given back."""
        layer = self.layers[number]
        mx.eval(list(_arrays_in(made)) + _private_arrays(layer.module))
        _drop_compiled(layer.module)
        layer.module.update(tree_unflatten(layer.parked))
        with self._lock:
            self._held -= layer.nbytes

    def abandon(self, number: int) -> None:
        """The layer's call failed: its arrays go back as after a call."""
        layer = self.layers[number]
        layer.module.update(tree_unflatten(layer.parked))
        with self._lock:
            self._held -= layer.nbytes

    # -- reading ---------------------------------------------------------------------------------

    def _read_ahead(self, number: int) -> None:
        if not self._streamed:
            return
        i = self._streamed.index(number)
        for k in range(1, self.split.ahead + 1):
            nxt = self.layers[self._streamed[(i + k) % len(self._streamed)]]
            if nxt.future is None and nxt.number != number:
                self._start(nxt)

    def _start(self, layer: _Layer) -> Future[dict[str, mx.array]]:
        with self._lock:
            self._held += layer.nbytes
            self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, self._held)
        layer.future = self.read(layer)
        return layer.future

    def read(self, layer: _Layer) -> Future[dict[str, mx.array]]:
        """Read a layer's parameters; the future's result maps each to its array."""
        return self._layer_pool.submit(self._read_layer, layer)

    def _read_layer(self, layer: _Layer) -> dict[str, mx.array]:
        """One tensor after another, each in pieces read at once on the pool: a layer in flight
        holds its arrays so far and one tensor's buffer, never a second copy of the layer."""
        out: dict[str, mx.array] = {}
        for param in layer.params:
            views = [self._buffers.lend(t.nbytes) if t.nbytes else memoryview(bytearray(0)) for t in param.inputs]
            reads = [
                self._pool.submit(_read_piece, self._fds[t.fd_index], view, t.start, s, e)
                for t, view in zip(param.inputs, views)
                for s, e in pieces(t.nbytes, _fanout(t.nbytes), 4096)
            ]
            for r in reads:  # every piece finished before the buffer can go back, even after an error
                r.exception()
            for r in reads:
                r.result()
            out[param.rel] = self._make(param, views)
            del views, reads
        with self.stats.lock:
            self.stats.read_bytes += layer.read_bytes
            self.stats.layers_read += 1
        return out

    @staticmethod
    def _make(param: _Param, views: list[memoryview]) -> mx.array:
        """The parameter's MLX array from its inputs' bytes (a copy, eagerly: nothing lazy leaves
        the reading thread). BF16 stored as it is crosses as its 16 bits, viewed on install."""
        if param.recipe is None:
            t = param.inputs[0]
            values: np.ndarray = np.frombuffer(
                views[0], dtype=_NP[t.dtype], count=t.nbytes // np.dtype(_NP[t.dtype]).itemsize
            )
            return mx.array(values.reshape(t.shape))
        hosts = [read_host(v, 0, t.nbytes, t.dtype, t.shape) for t, v in zip(param.inputs, views)]
        ((_, host),) = expert_trace.evaluate(param.recipe, hosts).items()
        return to_mx(host)

    def install(self, layer: _Layer, arrays: dict[str, mx.array]) -> dict[str, mx.array]:
        """The arrays as the model holds them: BF16 bits viewed, cast where the model computes wider."""
        out = {}
        for p in layer.params:
            a = arrays[p.rel]
            if p.recipe is None and p.inputs[0].dtype == "BF16":
                a = a.view(mx.bfloat16)
            out[p.rel] = a if a.dtype == p.dtype else a.astype(p.dtype)
        return out

    @property
    def held_bytes(self) -> int:
        return self._held

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._layer_pool.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _fanout(nbytes: int) -> int:
    return max(1, -(-nbytes // PIECE_BYTES))


def _open(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    if sys.platform == "darwin":
        with contextlib.suppress(OSError):  # advice: a file system that ignores it still reads
            fcntl.fcntl(fd, _F_NOCACHE, 1)
    return fd


def _read_piece(fd: int, view: memoryview, file_start: int, start: int, end: int) -> None:
    """view[start:end] from `file_start + start` of `fd`, then the page cache told to forget it."""
    done = start
    while done < end:
        n = os.preadv(fd, [view[done:end]], file_start + done)
        if n == 0:
            raise OSError(f"the core file ends {end - done} bytes early")
        done += n
    if hasattr(os, "posix_fadvise") and end > start:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, file_start + start, end - start, os.POSIX_FADV_DONTNEED)


def _arrays_in(value: object, depth: int = 0, seen: set[int] | None = None):
    """Every MLX array a layer call made or changed: in what it returned and in its arguments
    (caches, K3's residual blocks), nested in lists, dicts and plain objects."""
    seen = seen if seen is not None else set()
    if id(value) in seen or depth > 4:
        return
    seen.add(id(value))
    if isinstance(value, mx.array):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays_in(v, depth + 1, seen)
    elif isinstance(value, dict) and not isinstance(value, nn.Module):
        for v in value.values():
            yield from _arrays_in(v, depth + 1, seen)
    elif hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type, types.ModuleType)):
        for v in vars(value).values():
            yield from _arrays_in(v, depth + 1, seen)


def _private_arrays(module: nn.Module) -> list[mx.array]:
    """Arrays a layer keeps beside its parameters (K3's `_attn_res_w_eff`, made from its weights)."""
    return [v for m in module.modules() for k, v in m.items() if k.startswith("_") and isinstance(v, mx.array)]


def _drop_compiled(module: nn.Module) -> None:
    for m in module.modules():
        for k, v in list(vars(m).items()):
            if isinstance(v, _COMPILED):
                setattr(m, k, None)


_STREAMED_CLASSES: dict[type, type] = {}


def _streamed_class(layer_class: type) -> type:
    """`layer_class` whose call installs its arrays first and gives them back after (see above)."""
    if layer_class not in _STREAMED_CLASSES:

        class Streamed(layer_class):
            def __call__(self, *args, **kwargs):
                core, number = self.__dict__.get("_expertmesh_core", (None, None))
                if core is None:
                    return super().__call__(*args, **kwargs)
                core.enter(number)
                try:
                    made = super().__call__(*args, **kwargs)
                except BaseException:
                    core.abandon(number)
                    raise
                core.leave(number, (made, args, kwargs))
                return made

        Streamed.__name__ = Streamed.__qualname__ = f"Streamed{layer_class.__name__}"
        _STREAMED_CLASSES[layer_class] = Streamed
    return _STREAMED_CLASSES[layer_class]


# -- what streams: found once, when the model is loaded --------------------------------------


def core_files(model_dir: Path) -> list[Path]:
    """The core's files as mlx-lm loads them."""
    return sorted(Path(model_dir).glob("model*.safetensors"))


def file_layout(model_dir: Path, label: str) -> CoreLayout:
    """The core as the plan sees it, from its files' headers alone (before anything is loaded):
    tensors outside the decoder layers and the routers kept, the rest by layer."""
    resident = 0
    layers: dict[int, int] = {}  # layer number -> its bytes
    for path in core_files(model_dir):
        for t in safetensors_format.read_header(path).values():
            n = layer_number(t.name)
            module = t.name.rsplit(".", 1)[0]
            if n is None or is_router(module) or is_router(module.rsplit(".", 1)[0]):
                resident += t.nbytes
            else:
                layers[n] = layers.get(n, 0) + t.nbytes
    total = resident + sum(layers.values())
    return CoreLayout(total, label, resident, tuple(layers[n] for n in sorted(layers)))


def layer_modules(model: nn.Module) -> dict[str, int]:
    """Module path -> layer number, for each decoder layer (the module whose path ends in its number)."""
    out = {}
    for path, _ in model.named_modules():
        n = layer_number(path)
        if n is not None and path.rsplit(".", 1)[-1] == str(n) and not any(p in out for p in _prefixes(path)):
            out[path] = n
    return out


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def kept_modules(model: nn.Module) -> tuple[str, ...]:
    """Module paths whose parameters stay in memory inside a layer: routers, and the MoE modules'
    own vectors (the next layer's routing is guessed while this layer computes)."""
    out = []
    for path, m in model.named_modules():
        if is_router(path):
            out.append(path + ".")
        if isinstance(m, StreamingExperts):
            out.append(path.rsplit(".", 1)[0] + ".*")  # its parent's direct parameters only
    return tuple(out)


def is_kept(path: str, kept: tuple[str, ...]) -> bool:
    for k in kept:
        if k.endswith(".*"):
            base = k[:-1]
            if path.startswith(base) and "." not in path[len(base) :]:
                return True
        elif path.startswith(k):
            return True
    return False


def split_parameters(model: nn.Module) -> tuple[dict[str, mx.array], dict[int, tuple[str, dict[str, mx.array]]]]:
    """(the parameters a streamed core keeps, layer number -> (its module path, its streamable
    parameters)): what streams, as `stream_core` and the memory plan (engine/model_sizes.py) see it."""
    layer_paths = layer_modules(model)
    kept_paths = kept_modules(model)
    kept: dict[str, mx.array] = {}
    layers: dict[int, tuple[str, dict[str, mx.array]]] = {}
    for path, array in flat_parameters(model).items():
        owner = next((p for p in _prefixes(path) if p in layer_paths), None)
        if owner is None or is_kept(path, kept_paths):
            kept[path] = array
        else:
            layers.setdefault(layer_paths[owner], (owner, {}))[1][path] = array
    return kept, dict(sorted(layers.items()))


def stream_core(
    model: nn.Module, model_dir: Path, standins: dict | None, budget_bytes: int, label: str
) -> StreamedCore:
    """Make `model` (loaded lazily, `load_core_model(lazy=True)`) stream its core from `model_dir`
    within `budget_bytes`: kept parameters evaluated, pinned layers read, the rest streamed.
    Call it on the MLX thread.

    Raises:
        UnsupportedModelError: mlx-lm's sanitize cannot be followed on this core's tensors.
    """
    files = core_files(model_dir)
    stored: dict[str, _Tensor] = {}
    for i, path in enumerate(files):
        for t in safetensors_format.read_header(path).values():
            stored[t.name] = _Tensor(i, t.start, t.nbytes, t.dtype, t.shape)
    exprs = _trace(model, stored, standins)
    kept_params, streamable = split_parameters(model)
    kept = list(kept_params.values())
    modules = dict(model.named_modules())
    layers: dict[int, _Layer] = {}
    for n, (owner, params) in streamable.items():
        ps, parked = [], []
        for name, array in params.items():
            param = _param(name, owner, array, exprs, stored)
            if param is None:  # made by sanitize in a way not followed: kept
                kept.append(array)
            else:
                ps.append(param)
                parked.append((param.rel, array))
        if ps:
            nbytes = sum(a.nbytes for _, a in parked)
            layers[n] = _Layer(n, modules[owner], ps, parked, nbytes, sum(t.nbytes for p in ps for t in p.inputs))
    mx.eval(kept)  # MLX reads the kept parameters now, from the same files
    order = sorted(layers)
    resident = sum(a.nbytes for a in kept)
    layout = CoreLayout(resident + sum(lay.nbytes for lay in layers.values()), label, resident,
                        tuple(layers[n].nbytes for n in order))  # fmt: skip
    split = stream_split(layout, budget_bytes)
    read = sum(layers[n].read_bytes for n in order[split.pinned :]) if split.ahead else 0
    split = dataclasses.replace(
        split, read_bytes_per_token=read
    )  # stored tensors, as read (a fused K3 q/k/v: its parts)
    core = StreamedCore(layers, order, files, layout, split, budget_bytes)
    for n in order[: split.pinned]:  # read once, kept for good
        lay = layers[n]
        arrays = core.read(lay).result()
        lay.module.update(tree_unflatten(list(core.install(lay, arrays).items())))
        mx.eval(lay.module.parameters())
        core._held += lay.nbytes
    core.stats = CoreStreamStats(peak_held_bytes=core._held)  # pinning is loading, not streaming
    for n in order[split.pinned :]:
        module = layers[n].module
        module.__class__ = _streamed_class(type(module))
        object.__setattr__(module, "_expertmesh_core", (core, n))
    return core


def _param(path: str, owner: str, array: mx.array, exprs: dict, stored: dict[str, _Tensor]) -> _Param | None:
    """How a layer's parameter is read, or None to keep it (sanitize made it in a way not followed)."""
    expr = exprs.get(path)
    if not isinstance(expr, expert_trace.Sym):
        return None
    rel = path[len(owner) + 1 :]
    if expr.op == "leaf" and expr.attrs[0] in stored and tuple(stored[expr.attrs[0]].shape) == tuple(array.shape):
        return _Param(rel, [stored[expr.attrs[0]]], None, array.dtype)
    try:
        inputs, recipe = expert_trace.encode_expert({path: expr})
    except expert_trace.Unaddressable:
        return None
    if any(row is not None or name not in stored for name, row in inputs):
        return None
    return _Param(rel, [stored[name] for name, _ in inputs], json.loads(recipe), array.dtype)


def _trace(model: nn.Module, stored: dict[str, _Tensor], standins: dict | None) -> dict:
    """What mlx-lm's sanitize makes of the stored tensors (and the experts' stand-ins, where the
    architecture's sanitize needs to see them), symbolically."""
    tensors = {name: (t.dtype, t.shape) for name, t in stored.items()}
    tensors.update(standins or {})
    base = super(type(model), model)  # mlx-lm's own class: the loading subclass adds stand-ins of its own
    try:
        return expert_trace.trace_sanitize(base, tensors)
    except expert_trace.Untraceable as e:
        raise UnsupportedModelError(f"the core cannot be streamed: {e}") from None
