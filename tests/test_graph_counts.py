"""The instrument `bench --compute` and the slot tests count with (expertmesh/devtools/graph_counts.py):
kernels as a GPU launches them, host syncs as a token waits for them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from expertmesh.devtools.graph_counts import GraphCounter


def test_views_launch_nothing_and_a_fast_op_is_one_kernel() -> None:
    x, w = mx.ones((2, 8)), mx.ones((8,))
    mx.eval(x, w)
    with GraphCounter() as counts:
        y = (x * 2).reshape(4, 4).T  # one multiply; the reshape and the transpose are views
        mx.eval(y)
        assert counts.kernels == counts.fast_adjusted_kernels == 1
        z = mx.fast.rms_norm(x, w, 1e-5)  # several primitives on a CPU, one kernel on Metal
        mx.eval(z)
    assert counts.kernels > 2
    assert counts.fast_adjusted_kernels == 2
    assert np.allclose(np.array(z), 1.0)


def test_a_sync_is_a_wait_for_work() -> None:
    x = mx.ones((4,))
    mx.eval(x)
    with GraphCounter() as counts:
        mx.eval(x)  # nothing to run
        assert counts.syncs == 0
        y = x + 1
        mx.async_eval(y)  # handed over, not waited for
        assert counts.syncs == 0 and counts.kernels == 1
        assert y.tolist() == [2.0] * 4  # waits for it
        assert counts.syncs == 1
        assert np.array(y + 1).tolist() == [3.0] * 4 and counts.syncs == 2
        assert bool((y > 0).all()) and counts.syncs == 3
        _ = y.tolist()  # its values are here: no wait
        assert counts.syncs == 3
    with GraphCounter() as after:
        mx.eval(x + 1)
    assert after.syncs == 1 and counts.syncs == 3  # each counter counts only while installed
