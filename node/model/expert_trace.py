"""Which upstream tensors feed which routed expert, learnt from mlx-lm's own `sanitize`.

Every mlx-lm architecture maps its makers' checkpoint onto its parameters in `Model.sanitize`:
it stacks per-expert tensors, splits fused gate/up tensors, transposes, reinterprets packed
bytes, dequantises fp8. Rather than guessing experts from tensor names, expertmesh runs that
very method on symbolic stand-ins of the checkpoint's tensors (name, dtype and shape, no data):
each mx operation sanitize applies is recorded instead of computed, so every parameter comes
back as an expression over upstream tensors. A parameter of a `SwitchGLU` holds all experts on
axis 0; `select` narrows its expression to one expert, which leaves exactly the bytes that
expert needs (whole per-expert tensors, or one slice of a stacked tensor on its first axis) and
the few operations that turn them into that expert's part of the parameter: its recipe, which
the codec replays on the fetched bytes (`evaluate`, in numpy, rounding as MLX rounds), so the
streamed model computes with exactly the values mlx-lm's sanitize makes of the whole tensor.

Nothing here depends on tensor order in a file, on names, or on a list of architectures: a new
mlx-lm architecture is covered as soon as its sanitize uses operations this module can narrow;
one that does not gets an `Unaddressable` naming the tensors and the operation.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from expertmesh.node.model import safetensors_format

# safetensors dtype -> the dtype `mx.load` gives the tensor (fp8 kinds arrive as raw bytes).
SAFETENSORS_DTYPES: dict[str, mx.Dtype] = {
    "BOOL": mx.bool_,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U64": mx.uint64,
    "I64": mx.int64,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "F32": mx.float32,
    "F64": mx.float64,
    "F8_E4M3": mx.uint8,
    "F8_E5M2": mx.uint8,
    "F8_E8M0": mx.uint8,
}
_DTYPE_NAMES = {v: k for k, v in vars(mx).items() if isinstance(v, mx.Dtype)}


class Untraceable(Exception):
    """sanitize did something to a stand-in that cannot be recorded (read its values, say)."""


class Unaddressable(Exception):
    """An expert's part of a parameter is not a function of that expert's own bytes alone.

    The message says how the experts are stored (the X of "cannot yet address experts stored
    as X"), for the caller to name the model.
    """


def _lifts_opaque(method: Callable[..., Any]) -> Callable[..., Any]:
    """An operation on a result of unknown shape is itself only recorded by name."""

    def wrapper(self: Sym, *args, **kwargs):
        if _unknown((self, *args, *kwargs.values())):
            return _opaque(f".{method.__name__}()", (self, *args), kwargs)
        return method(self, *args, **kwargs)

    wrapper.__name__ = method.__name__
    return wrapper


def _unknown(values) -> bool:
    """Whether a stand-in of unknown shape is among `values` (nested lists and dicts included)."""
    for v in values:
        if isinstance(v, Sym):
            if v._shape is None:
                return True
        elif isinstance(v, list | tuple) and _unknown(v) or isinstance(v, dict) and _unknown(v.values()):
            return True
    return False


class Sym:
    """A symbolic tensor: an operation on other symbolic tensors, with its shape and dtype.

    `op` is one of the recipe operations (see `_encode`), `"leaf"` (an upstream tensor),
    `"leaf_slice"` (row `index` of an upstream tensor) or `"opaque"` (an operation recorded
    only by name, whose result cannot be narrowed to an expert).
    """

    __slots__ = ("op", "args", "attrs", "_shape", "dtype")
    __array_priority__ = 1000  # so `scalar * sym` reaches __rmul__

    def __init__(self, op: str, args: tuple, attrs: tuple, shape: tuple[int, ...] | None, dtype: mx.Dtype | None):
        self.op, self.args, self.attrs, self._shape, self.dtype = op, args, attrs, shape, dtype

    # -- what sanitize reads --------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        if self._shape is None:
            raise Untraceable(f"the shape of the result of {self.attrs[0] if self.op == 'opaque' else self.op}")
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        if self.dtype is None:
            raise Untraceable("the dtype of an opaque result")
        return self.dtype.size

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"Sym({self.op}, shape={self._shape}, dtype={self.dtype})"

    def __bool__(self) -> bool:
        raise Untraceable("the truth value of a tensor")

    def item(self) -> Any:
        raise Untraceable("a tensor's value (item)")

    def tolist(self) -> Any:
        raise Untraceable("a tensor's values (tolist)")

    def __iter__(self) -> Iterator[Sym]:
        return (self[i] for i in range(self.shape[0]))

    # -- the operations ---------------------------------------------------------------------------

    @_lifts_opaque
    def reshape(self, *shape, stream=None) -> Sym:
        if len(shape) == 1 and isinstance(shape[0], list | tuple):
            shape = tuple(shape[0])
        return _reshape(self, tuple(int(d) for d in shape))

    @_lifts_opaque
    def flatten(self, start_axis: int = 0, end_axis: int = -1, stream=None) -> Sym:
        n = self.ndim
        a, b = start_axis % n if n else 0, end_axis % n if n else 0
        return _reshape(self, self.shape[:a] + (math.prod(self.shape[a : b + 1]),) + self.shape[b + 1 :])

    @_lifts_opaque
    def squeeze(self, axis=None, stream=None) -> Sym:
        axes = range(self.ndim) if axis is None else [axis] if isinstance(axis, int) else axis
        drop = {a % self.ndim for a in axes if axis is not None or self.shape[a] == 1}
        return _reshape(self, tuple(d for i, d in enumerate(self.shape) if i not in drop))

    @_lifts_opaque
    def astype(self, dtype: mx.Dtype, stream=None) -> Sym:
        return Sym("astype", (self,), (dtype,), self.shape, dtype)

    @_lifts_opaque
    def view(self, dtype: mx.Dtype, stream=None) -> Sym:
        shape = self.shape
        if shape and dtype.size != self.itemsize:
            last = shape[-1] * self.itemsize
            if last % dtype.size:
                raise Untraceable(f"view of {shape} {self.dtype} as {dtype}")
            shape = shape[:-1] + (last // dtype.size,)
        return Sym("view", (self,), (dtype,), shape, dtype)

    @_lifts_opaque
    def transpose(self, *axes, stream=None) -> Sym:
        if len(axes) == 1 and isinstance(axes[0], list | tuple):
            axes = tuple(axes[0])
        perm = tuple(a % self.ndim for a in axes) if axes else tuple(reversed(range(self.ndim)))
        return _transpose(self, perm)

    @property
    def T(self) -> Sym:  # mx.array's name
        return self.transpose()

    @_lifts_opaque
    def swapaxes(self, a: int, b: int, stream=None) -> Sym:
        perm = list(range(self.ndim))
        a, b = a % self.ndim, b % self.ndim
        perm[a], perm[b] = perm[b], perm[a]
        return _transpose(self, tuple(perm))

    @_lifts_opaque
    def moveaxis(self, source: int, destination: int, stream=None) -> Sym:
        perm = list(range(self.ndim))
        s = perm.pop(source % self.ndim)
        perm.insert(destination % self.ndim, s)
        return _transpose(self, tuple(perm))

    @_lifts_opaque
    def split(self, indices_or_sections, axis: int = 0, stream=None) -> list[Sym]:
        return _split(self, indices_or_sections, axis)

    @_lifts_opaque
    def __getitem__(self, key) -> Sym:
        return _index(self, key)

    @_lifts_opaque
    def __mul__(self, other):
        return _binary("multiply", self, other)

    @_lifts_opaque
    def __rmul__(self, other):
        return _binary("multiply", other, self)

    @_lifts_opaque
    def __add__(self, other):
        return _binary("add", self, other)

    @_lifts_opaque
    def __radd__(self, other):
        return _binary("add", other, self)

    @_lifts_opaque
    def __sub__(self, other):
        return _binary("subtract", self, other)

    @_lifts_opaque
    def __rsub__(self, other):
        return _binary("subtract", other, self)

    @_lifts_opaque
    def __truediv__(self, other):
        return _binary("divide", self, other)

    @_lifts_opaque
    def __rtruediv__(self, other):
        return _binary("divide", other, self)

    @_lifts_opaque
    def __neg__(self):
        return Sym("negative", (self,), (), self.shape, self.dtype)

    def __getattr__(self, name: str) -> Callable[..., Sym]:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: _opaque(f".{name}()", (self, *a), k)


def leaf(name: str, dtype: str, shape: tuple[int, ...]) -> Sym:
    """The stand-in of upstream tensor `name`.

    A dtype of the format that `mx.load` cannot read (F4, the F6s, the FNUZ fp8s, C64 to the codec)
    stands in as bytes: sanitize may still drop the tensor (an unused precomputed one), and where
    one is kept, the index refuses the model by name (expert_index.py, `_check_dtypes`).
    """
    if dtype in SAFETENSORS_DTYPES:
        return Sym("leaf", (), (name,), tuple(shape), SAFETENSORS_DTYPES[dtype])
    if dtype in safetensors_format.DTYPE_BITS:
        return Sym("leaf", (), (name,), tuple(shape), mx.uint8)
    raise Untraceable(f"tensor {name} of dtype {dtype}")


def _opaque(what: str, args: tuple, kwargs: dict) -> Sym:
    """A result sanitize made with an operation not recorded: fine for the core (its tensors are
    loaded by mlx-lm itself), fatal only if it reaches an expert's parameter."""
    inputs = tuple(a for a in _flat(args) + _flat(tuple(kwargs.values())) if isinstance(a, Sym))
    return Sym("opaque", inputs, (what,), None, None)


def _flat(values: tuple) -> list:
    out = []
    for v in values:
        if isinstance(v, list | tuple):
            out += _flat(tuple(v))
        elif isinstance(v, dict):
            out += _flat(tuple(v.values()))
        else:
            out.append(v)
    return out


def _reshape(x: Sym, shape: tuple[int, ...]) -> Sym:
    if shape.count(-1) == 1:
        known = math.prod(d for d in shape if d != -1)
        shape = tuple(x.size // known if d == -1 else d for d in shape)
    if math.prod(shape) != x.size:
        raise Untraceable(f"reshape of {x.shape} to {shape}")
    return x if shape == x.shape else Sym("reshape", (x,), (shape,), shape, x.dtype)


def _transpose(x: Sym, perm: tuple[int, ...]) -> Sym:
    if perm == tuple(range(len(perm))):
        return x
    return Sym("transpose", (x,), (perm,), tuple(x.shape[p] for p in perm), x.dtype)


def _index(x: Sym, key) -> Sym:
    """x[key] for ints, slices, None and Ellipsis; items normalised to ("s", start, stop, step),
    ("i", index) or ("n",) per axis, so the result's shape and its narrowing are plain arithmetic."""
    if not isinstance(key, tuple):
        key = (key,)
    shape = x.shape
    real = sum(1 for k in key if k is not None and k is not Ellipsis)
    items: list[tuple] = []
    axis = 0
    for k in key:
        if k is Ellipsis:
            for _ in range(len(shape) - real):
                items.append(("s", 0, shape[axis], 1))
                axis += 1
        elif k is None:
            items.append(("n",))
        elif isinstance(k, int) and not isinstance(k, bool):
            n = shape[axis]
            if not -n <= k < n:
                raise Untraceable(f"index {k} out of range {n}")
            items.append(("i", k % n))
            axis += 1
        elif isinstance(k, slice):
            items.append(("s", *k.indices(shape[axis])))
            axis += 1
        else:
            return _opaque("fancy indexing", (x, k), {})
    while axis < len(shape):
        items.append(("s", 0, shape[axis], 1))
        axis += 1
    return _make_index(x, tuple(items))


def _make_index(x: Sym, items: tuple) -> Sym:
    out: list[int] = []
    axis = 0
    for it in items:
        if it[0] == "n":
            out.append(1)
            continue
        if it[0] == "s":
            out.append(len(range(it[1], it[2], it[3])))
        axis += 1
    if all(it[0] == "s" and it[1:] == (0, x.shape[a], 1) for a, it in enumerate(items)) and len(items) == x.ndim:
        return x
    return Sym("index", (x,), (items,), tuple(out), x.dtype)


def _split(x: Sym, indices_or_sections, axis: int = 0) -> list[Sym]:
    axis %= x.ndim
    n = x.shape[axis]
    if isinstance(indices_or_sections, int):
        if n % indices_or_sections:
            raise Untraceable(f"split of {n} into {indices_or_sections}")
        step = n // indices_or_sections
        bounds = [i * step for i in range(indices_or_sections + 1)]
    else:
        bounds = [0, *[int(i) for i in indices_or_sections], n]
    parts = []
    for a, b in zip(bounds, bounds[1:]):
        key = tuple(slice(None) for _ in range(axis)) + (slice(a, b),)
        parts.append(_index(x, key))
    return parts


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    out = []
    for p, q in zip(a, b):
        if p != q and 1 not in (p, q):
            raise Untraceable(f"broadcast of {a} with {b}")
        out.append(max(p, q))
    return tuple(out)


def _binary(op: str, a, b) -> Sym:
    for v in (a, b):
        if not isinstance(v, Sym | int | float):
            return _opaque(op, (a, b), {})
    shape_a = a.shape if isinstance(a, Sym) else ()
    shape_b = b.shape if isinstance(b, Sym) else ()
    try:  # MLX's own type promotion, on empty arrays: nothing is computed
        probe = [mx.zeros((0,), v.dtype) if isinstance(v, Sym) else v for v in (a, b)]
        dtype = getattr(mx, op)(*probe).dtype
    except (ValueError, TypeError) as e:
        raise Untraceable(f"{op} of {a!r} and {b!r}: {e}") from None
    return Sym(op, (a, b), (), _broadcast(shape_a, shape_b), dtype)


# -- the mx functions sanitize calls, on stand-ins -----------------------------------------------


def _stack(arrays, axis: int = 0, stream=None) -> Sym:
    arrays = list(arrays)
    first = arrays[0]
    if any(not isinstance(a, Sym) or a.shape != first.shape or a.dtype != first.dtype for a in arrays):
        return _opaque("stack of unlike tensors", tuple(arrays), {})
    axis %= first.ndim + 1
    shape = first.shape[:axis] + (len(arrays),) + first.shape[axis:]
    return Sym("stack", tuple(arrays), (axis,), shape, first.dtype)


def _concatenate(arrays, axis: int = 0, stream=None) -> Sym:
    arrays = list(arrays)
    if any(not isinstance(a, Sym) for a in arrays):
        return _opaque("concatenate", tuple(arrays), {})
    first = arrays[0]
    axis %= first.ndim
    total = sum(a.shape[axis] for a in arrays)
    return Sym(
        "concatenate", tuple(arrays), (axis,), first.shape[:axis] + (total,) + first.shape[axis + 1 :], first.dtype
    )


def _pad(x: Sym, pad_width, mode: str = "constant", constant_values=0, stream=None) -> Sym:
    if mode != "constant" or not isinstance(constant_values, int | float):
        return _opaque("pad", (x,), {})
    if isinstance(pad_width, int):
        widths = ((pad_width, pad_width),) * x.ndim
    else:
        widths = tuple((p, p) if isinstance(p, int) else tuple(p) for p in pad_width)
        if len(widths) == 1:
            widths = widths * x.ndim
    shape = tuple(d + lo + hi for d, (lo, hi) in zip(x.shape, widths))
    return Sym("pad", (x,), (widths, constant_values), shape, x.dtype)


def _from_fp8(x: Sym, dtype: mx.Dtype = mx.bfloat16, stream=None) -> Sym:
    return Sym("from_fp8", (x,), (dtype,), x.shape, dtype)


def _dequantize(w, scales, biases=None, group_size=None, bits=None, mode="affine", dtype=None, stream=None) -> Sym:
    if not isinstance(w, Sym) or group_size is None or bits is None:
        return _opaque("dequantize", (w, scales, biases), {})
    shape = w.shape[:-1] + (w.shape[-1] * 32 // bits,)
    out = dtype or (scales.dtype if mode == "affine" else mx.bfloat16)
    return Sym("dequantize", (w, scales, biases), (group_size, bits, mode, dtype), shape, out)


_SYM_FUNCS: dict[str, Callable[..., Any]] = {
    "stack": _stack,
    "concatenate": _concatenate,
    "concat": _concatenate,
    "split": lambda x, s, axis=0, stream=None: _split(x, s, axis),
    "contiguous": lambda x, allow_col_major=False, stream=None: x,
    "reshape": lambda x, shape, stream=None: x.reshape(shape),
    "flatten": lambda x, start_axis=0, end_axis=-1, stream=None: x.flatten(start_axis, end_axis),
    "swapaxes": lambda x, a, b, stream=None: x.swapaxes(a, b),
    "transpose": lambda x, axes=None, stream=None: x.transpose(*(axes or ())),
    "moveaxis": lambda x, s, d, stream=None: x.moveaxis(s, d),
    "squeeze": lambda x, axis=None, stream=None: x.squeeze(axis),
    "expand_dims": lambda x, axis, stream=None: x[(slice(None),) * (axis % (x.ndim + 1)) + (None,)],
    "view": lambda x, dtype, stream=None: x.view(dtype),
    "astype": lambda x, dtype, stream=None: x.astype(dtype),
    "pad": _pad,
    "from_fp8": _from_fp8,
    "dequantize": _dequantize,
    "multiply": lambda a, b, stream=None: _binary("multiply", a, b),
    "add": lambda a, b, stream=None: _binary("add", a, b),
    "subtract": lambda a, b, stream=None: _binary("subtract", a, b),
    "divide": lambda a, b, stream=None: _binary("divide", a, b),
    "negative": lambda x, stream=None: -x,
}


def _has_sym(values) -> bool:
    for v in values:
        if isinstance(v, Sym):
            return True
        if isinstance(v, list | tuple) and _has_sym(v) or isinstance(v, dict) and _has_sym(v.values()):
            return True
    return False


class _MxProxy(types.ModuleType):
    """`mlx.core` as sanitize sees it while tracing: calls with a stand-in among their arguments
    are recorded, every other call (another thread's forward pass, say) goes to MLX unchanged."""

    def __init__(self, real: types.ModuleType, prefix: str = ""):
        super().__init__(real.__name__)
        self._real, self._prefix = real, prefix

    def __getattr__(self, name: str):
        value = getattr(self._real, name)
        if isinstance(value, types.ModuleType):
            return _MxProxy(value, f"{self._prefix}{name}.")
        if not callable(value) or isinstance(value, type):
            return value
        symbolic = _SYM_FUNCS.get(name) if not self._prefix else None
        what = f"mx.{self._prefix}{name}"

        def call(*args, **kwargs):
            if _has_sym(args) or _has_sym(kwargs.values()):
                if symbolic is None or _unknown((*args, *kwargs.values())):
                    return _opaque(what, args, kwargs)
                return symbolic(*args, **kwargs)
            return value(*args, **kwargs)

        return call


_TRACE_LOCK = threading.Lock()


@contextmanager
def _symbolic_mx() -> Iterator[None]:
    """Point every loaded mlx-lm model module's `mx` at the recording proxy, then back."""
    with _TRACE_LOCK:
        proxy = _MxProxy(mx)
        patched = [
            m for n, m in list(sys.modules.items()) if n.startswith("mlx_lm.models.") and getattr(m, "mx", None) is mx
        ]
        for m in patched:
            vars(m)["mx"] = proxy
        try:
            yield
        finally:
            for m in patched:
                vars(m)["mx"] = mx


def trace_sanitize(model: Any, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """What `model.sanitize` makes of a checkpoint holding `tensors` (name -> dtype, shape).

    Raises:
        Untraceable: sanitize needed the values of a tensor, or failed on the stand-ins.
    """
    weights = {name: leaf(name, dtype, shape) for name, (dtype, shape) in tensors.items()}
    if not hasattr(model, "sanitize"):
        return weights
    with _symbolic_mx():
        try:
            return model.sanitize(weights)
        except Untraceable as e:
            raise Untraceable(f"tracing mlx-lm's sanitize needed {e}") from None
        except Exception as e:  # sanitize's own checks, run on names and shapes alone
            raise Untraceable(f"mlx-lm's sanitize fails on these tensors ({type(e).__name__}: {e})") from e


def leaves_of(node: Any) -> set[str]:
    """The upstream tensors an expression reads."""
    seen: set[int] = set()
    out: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if not isinstance(n, Sym) or id(n) in seen:
            continue
        seen.add(id(n))
        if n.op in ("leaf", "leaf_slice"):
            out.add(n.attrs[0])
        stack.extend(n.args)
    return out


def opaque_ops(node: Any) -> list[str]:
    """The unrecorded operations on the way from the upstream tensors to `node`."""
    out: list[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, Sym):
            if n.op == "opaque":
                out.append(n.attrs[0])
            stack.extend(n.args)
    return out


def fingerprint(node: Any) -> Any:
    """A comparable form of an expression: two traces made the same value iff these are equal."""
    memo: dict[int, Any] = {}

    def fp(n: Any) -> Any:
        if not isinstance(n, Sym):
            return ("value", n) if isinstance(n, bool | int | float | str | type(None)) else ("value", type(n).__name__)
        if id(n) not in memo:
            attrs = tuple(_DTYPE_NAMES.get(a, a) if isinstance(a, mx.Dtype) else a for a in n.attrs)
            memo[id(n)] = (n.op, repr(attrs), n._shape, tuple(fp(a) for a in n.args))
        return memo[id(n)]

    return fp(node)


# -- one expert's part of a stacked parameter ------------------------------------------------------


def select(x: Sym, axis: int, i: int) -> Sym:
    """`x` with `axis` removed at index `i`, pushed down to the upstream tensors.

    Raises:
        Unaddressable: the slice is not made of whole tensors and first-axis slices of tensors.
    """
    op = x.op
    if op == "leaf":
        if axis != 0:
            raise Unaddressable(f"{_describe(x)} with the experts on axis {axis}, not the first")
        return Sym("leaf_slice", (), (x.attrs[0], i, x.shape[0]), x.shape[1:], x.dtype)
    if op == "stack":
        (a,) = x.attrs
        if axis == a:
            return x.args[i]
        inner = axis if axis < a else axis - 1
        return _stack([select(y, inner, i) for y in x.args], a - 1 if axis < a else a)
    if op == "concatenate":
        (a,) = x.attrs
        if axis == a:
            for y in x.args:
                if i < y.shape[a]:
                    return select(y, a, i)
                i -= y.shape[a]
        return _concatenate([select(y, axis, i) for y in x.args], a - 1 if axis < a else a)
    if op == "index":
        (items,) = x.attrs
        out_axis, in_axis = -1, 0
        for j, it in enumerate(items):
            if it[0] != "i":
                out_axis += 1
            if out_axis == axis:
                rest = items[:j] + items[j + 1 :]
                if it[0] == "n":
                    return _make_index(x.args[0], rest)
                y = select(x.args[0], in_axis, it[1] + i * it[3])
                return _make_index(y, rest)
            if it[0] != "n":
                in_axis += 1
    if op == "reshape":
        (src,) = x.args
        out = x.shape
        prefix = math.prod(out[:axis])
        for k in range(src.ndim):
            if math.prod(src.shape[:k]) == prefix and src.shape[k] == out[axis]:
                return _reshape(select(src, k, i), out[:axis] + out[axis + 1 :])
        raise Unaddressable(f"{_describe_all(x)} reshaped so that the experts are not one axis ({src.shape} -> {out})")
    if op == "transpose":
        (perm,) = x.attrs
        src_axis = perm[axis]
        rest = [p - (p > src_axis) for j, p in enumerate(perm) if j != axis]
        return _transpose(select(x.args[0], src_axis, i), tuple(rest))
    if op in ("view", "astype", "from_fp8", "negative"):
        if op == "view" and axis == x.ndim - 1:
            raise Unaddressable(f"{_describe_all(x)} viewed as another dtype along the expert axis")
        y = select(x.args[0], axis, i)
        return Sym(op, (y,), x.attrs, x.shape[:axis] + x.shape[axis + 1 :], x.dtype)
    if op in ("multiply", "add", "subtract", "divide"):
        args = []
        for v in x.args:
            if isinstance(v, Sym):
                k = axis - (x.ndim - v.ndim)
                if k >= 0:
                    v = select(v, k, 0 if v.shape[k] == 1 else i)
            args.append(v)
        return _binary(op, *args)
    if op == "pad":
        widths, value = x.attrs
        if tuple(widths[axis]) != (0, 0):
            raise Unaddressable(f"{_describe_all(x)} padded along the expert axis")
        return _pad(select(x.args[0], axis, i), widths[:axis] + widths[axis + 1 :], constant_values=value)
    if op == "dequantize":
        if axis == x.ndim - 1:
            raise Unaddressable(f"{_describe_all(x)} quantised along the expert axis")
        w, s, b = (select(v, axis, i) if isinstance(v, Sym) else v for v in x.args)
        return _dequantize(w, s, b, *x.attrs)
    if op == "opaque":
        raise Unaddressable(
            f"{_describe_all(x)} (sanitize applies {x.attrs[0]}, which expertmesh cannot narrow to one expert)"
        )
    raise Unaddressable(f"{_describe_all(x)} (operation {op})")


def _describe(x: Sym) -> str:
    name = _DTYPE_NAMES.get(x.dtype) if x.dtype is not None else None
    return f"{x.attrs[0]} {name or x.dtype}{list(x.shape)}"


def _dtype_name(x: Sym) -> str:
    """The MLX name of the dtype of `x`'s result. Raises Unaddressable when it is not known."""
    if x.dtype is None:
        raise Unaddressable(f"{_describe_all(x)} (a result of unknown dtype)")
    return _DTYPE_NAMES[x.dtype]


def _describe_all(x: Sym) -> str:
    names = sorted(leaves_of(x))
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return shown or "constants"


# -- recipes: the narrowed expressions, as data ------------------------------------------------------


def encode_expert(targets: dict[str, Sym]) -> tuple[list[tuple[str, int | None]], str]:
    """One expert's narrowed parameters as (its inputs, its recipe).

    Inputs are `(tensor name, row)` — row None for a whole tensor — in first-use order, so two
    experts stored alike get the same recipe text whatever their tensors' order in a file.
    """
    inputs: dict[tuple[str, int | None], int] = {}
    memo: dict[int, Any] = {}

    def enc(n: Any) -> Any:
        if not isinstance(n, Sym):
            if isinstance(n, bool | int | float):
                return ["const", n]
            raise Unaddressable(f"a constant of type {type(n).__name__}")
        if id(n) in memo:
            return memo[id(n)]
        if n.op == "leaf":
            out = ["in", inputs.setdefault((n.attrs[0], None), len(inputs))]
        elif n.op == "leaf_slice":
            out = ["in", inputs.setdefault((n.attrs[0], n.attrs[1]), len(inputs))]
        elif n.op in ("stack", "concatenate"):
            out = [n.op, [enc(a) for a in n.args], n.attrs[0]]
        elif n.op == "index":
            out = ["index", enc(n.args[0]), [list(it) for it in n.attrs[0]]]
        elif n.op == "reshape":
            out = ["reshape", enc(n.args[0]), list(n.attrs[0])]
        elif n.op == "transpose":
            out = ["transpose", enc(n.args[0]), list(n.attrs[0])]
        elif n.op in ("view", "astype", "from_fp8"):
            out = [n.op, enc(n.args[0]), _DTYPE_NAMES[n.attrs[0]]]
        elif n.op == "negative":
            out = ["negative", enc(n.args[0])]
        elif n.op in ("multiply", "add", "subtract", "divide"):
            out = [n.op, enc(n.args[0]), enc(n.args[1]), _dtype_name(n)]
        elif n.op == "pad":
            out = ["pad", enc(n.args[0]), [list(w) for w in n.attrs[0]], n.attrs[1]]
        else:
            raise Unaddressable(f"{_describe_all(n)} (operation {n.op})")
        memo[id(n)] = out
        return out

    doc = {name: enc(targets[name]) for name in sorted(targets)}
    return list(inputs), json.dumps(doc, separators=(",", ":"))


# An array on its way to MLX, as the codec holds it (node/model/codec.py): numpy values and the MLX
# dtype they become. A bfloat16 is held widened to float32 (exact), numpy having no bfloat16.
Host = tuple[Any, mx.Dtype]

_NP = {
    mx.bool_: np.bool_,
    mx.uint8: np.uint8,
    mx.int8: np.int8,
    mx.uint16: np.uint16,
    mx.int16: np.int16,
    mx.uint32: np.uint32,
    mx.int32: np.int32,
    mx.uint64: np.uint64,
    mx.int64: np.int64,
    mx.float16: np.float16,
    mx.float32: np.float32,
    mx.bfloat16: np.float32,  # held widened
}


def evaluate(recipe: dict[str, Any], inputs: list[Host]) -> dict[str, Host]:
    """Apply a recipe (parsed JSON) to an expert's input arrays, in numpy, exactly as MLX computes
    the same operations: rounding to bfloat16 and float16 after each operation that makes one,
    MLX's type promotion (recorded in the recipe), fp8 decoded by its definition. Nothing runs in
    MLX, so a fetch worker encodes no MLX work (see node/model/codec.py)."""

    def ev(n: Any) -> Any:
        op = n[0]
        if op == "in":
            return inputs[n[1]]
        if op == "const":
            return n[1]
        if op in ("stack", "concatenate"):
            parts = [ev(a) for a in n[1]]
            join = np.stack if op == "stack" else np.concatenate
            return join([p[0] for p in parts], axis=n[2]), parts[0][1]
        if op in ("multiply", "add", "subtract", "divide"):
            out = getattr(mx, n[3])
            wide = np.float32 if mx.issubdtype(out, mx.floating) else _NP[out]
            x, y = (v[0].astype(wide) if isinstance(v, tuple) else v for v in (ev(n[1]), ev(n[2])))
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                return _cast(getattr(np, op)(x, y), out, out)
        values, dtype = ev(n[1])
        if op == "index":
            return values[tuple(_key_item(it) for it in n[2])], dtype
        if op == "reshape":
            return values.reshape(n[2]), dtype
        if op == "transpose":
            return values.transpose(n[2]), dtype
        if op == "view":
            return _view(values, dtype, getattr(mx, n[2]))
        if op in ("astype", "from_fp8"):
            if op == "from_fp8":
                values, dtype = _FP8_E4M3[values], mx.float32
            return _cast(values, dtype, getattr(mx, n[2]))
        if op == "negative":
            return _cast(-values, dtype, dtype)
        if op == "pad":
            return np.pad(values, [tuple(w) for w in n[2]], constant_values=n[3]), dtype
        raise ValueError(f"unknown recipe operation {op!r}")

    return {name: ev(expr) for name, expr in recipe.items()}


def _cast(values: Any, src: mx.Dtype, dst: mx.Dtype) -> Host:
    """values (held as `src` is) as `dst`, rounded as MLX rounds (to nearest, ties to even)."""
    if dst == mx.bfloat16:
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)
        rounded = np.where(np.isnan(values), bits | np.uint32(0x00400000), rounded)  # NaN stays NaN
        return rounded.astype(np.uint32).view(np.float32), dst
    if dst not in _NP:
        raise Unaddressable(f"a cast to {dst}")
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(values).astype(_NP[dst]), dst


def _view(values: Any, src: mx.Dtype, dst: mx.Dtype) -> Host:
    """The same bytes as another dtype (bfloat16 taken to and from its 16 stored bits)."""
    raw = np.ascontiguousarray(values)
    if src == mx.bfloat16:
        raw = (raw.view(np.uint32) >> 16).astype(np.uint16)
    out: np.ndarray = raw.view(np.uint16 if dst == mx.bfloat16 else _NP[dst])
    if dst == mx.bfloat16:
        out = (out.astype(np.uint32) << 16).view(np.float32)
    return out, dst


def _fp8_e4m3_table() -> Any:
    """float32 value of every e4m3 byte (OCP fp8: bias 7, no infinities, S.1111.111 is NaN)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    value = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp - 7))
    value = np.where((exp == 15) & (man == 7), np.nan, sign * value)
    return value.astype(np.float32)


_FP8_E4M3 = _fp8_e4m3_table()


def _key_item(it: list) -> Any:
    if it[0] == "n":
        return None
    if it[0] == "i":
        return it[1]
    _, start, stop, step = it
    return slice(start, None if stop < 0 else stop, step)
