"""Reading an evaluated MLX array from numpy (node/engine/host_view.py): no graph run of its own,
for every dtype the wire carries, and the evaluation of an unevaluated one counted, not hidden."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from expertmesh.devtools.graph_counts import GraphCounter
from expertmesh.node.engine.host_view import host_view


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_an_evaluated_array_is_read_without_running_anything(dtype: mx.Dtype) -> None:
    x = (mx.arange(12, dtype=mx.float32) / 7).astype(dtype).reshape(3, 4)
    mx.eval(x)
    with GraphCounter() as counts:
        host = host_view(x)
    assert counts.kernels == counts.syncs == 0
    bits = x.view(mx.uint16) if dtype == mx.bfloat16 else x
    assert host.shape == (3, 4) and np.array_equal(host, np.array(bits))


def test_a_bfloat16_array_not_in_c_order_is_read_as_its_bits() -> None:
    x = (mx.arange(12, dtype=mx.float32) / 7).astype(mx.bfloat16).reshape(3, 4).T
    mx.eval(x)
    assert np.array_equal(host_view(x), np.array(x.view(mx.uint16)))


def test_an_unevaluated_array_is_evaluated_where_counting_sees_it() -> None:
    x = mx.ones((2, 2), dtype=mx.bfloat16)
    mx.eval(x)
    with GraphCounter() as counts:
        host = host_view(x * 3)
    assert counts.syncs == 1
    assert np.array_equal(host, np.array((x * 3).view(mx.uint16)))
