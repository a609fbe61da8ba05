"""Activation rows on the wire (node/rpc/activations.py): a peer's answer with a NaN or an
infinity in it is refused from its bytes, as MLX's `isfinite` would judge it, in every dtype, and
its values read on the host are MLX's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from expertmesh.node.rpc import activations


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("value", [1.0, -0.0, 3e38, 65504.0, 1e-40, float("nan"), float("inf"), -float("inf")])
def test_finite_judges_the_bytes_as_mlx_judges_the_values(dtype: mx.Dtype, value: float) -> None:
    rows = mx.array([[0.5, value, -2.0]]).astype(dtype)
    assert activations.finite(activations.encode(rows)) == bool(mx.all(mx.isfinite(rows)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_as_float32_reads_the_values_mlx_holds(dtype: mx.Dtype) -> None:
    """The compute audit compares a peer's answer with this node's on the host, off the MLX thread."""
    x = (mx.arange(12, dtype=mx.float32).reshape(3, 4) / 7 - 0.8).astype(dtype)
    assert np.array_equal(activations.as_float32(activations.encode(x)), np.array(x.astype(mx.float32)))
