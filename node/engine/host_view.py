"""An evaluated MLX array's values seen from numpy without a device round trip.

`np.array(x)` on an evaluated array reads its memory (Apple Silicon's is shared), but numpy has
no bfloat16, and MLX's `x.view(mx.uint16)` is a graph node of its own: evaluating it is a trip
through the device's queue and a wait, even with no kernel to run. Where bytes leave the process
(a peer's rows, a peer's answers) that trip was paid for every expert. Python's buffer protocol
hands the same memory over with its shape, so bfloat16 is read as its 16-bit patterns directly.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def host_view(x: mx.array) -> np.ndarray:
    """`x`'s values as numpy, bfloat16 as its uint16 bit patterns: a view of x's memory (a
    bfloat16 array not laid out in C order: a copy MLX makes). Evaluates `x` first, which runs
    nothing if it is evaluated already."""
    mx.eval(x)  # said here, not hidden in a buffer read, so that counting tools see it
    if x.dtype != mx.bfloat16:
        return np.array(x, copy=False)
    view = memoryview(x)  # type: ignore[arg-type]  # MLX exports a buffer; its stubs do not say so
    if view.c_contiguous:
        return np.frombuffer(view.cast("B"), dtype=np.uint16).reshape(view.shape)
    return np.array(x.view(mx.uint16), copy=False)
