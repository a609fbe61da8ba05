"""A layer's rows for each routed expert (node/engine/expert_rows.py): what a peer's call reads on
the host is, bit for bit, what a compute here gathers on the device, for each dtype the wire
carries and for inputs MLX does not lay out in C order."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from expertmesh.node.engine.expert_rows import GroupedRows, RoutedRows
from expertmesh.node.rpc import activations


def _bits(rows: mx.array) -> np.ndarray:
    return activations.to_numpy(rows)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_host_rows_are_the_device_rows(dtype: mx.Dtype, layout: str) -> None:
    a = mx.random.normal((2, 6, 8), key=mx.random.key(1)).astype(dtype)
    b = mx.random.normal((5, 8), key=mx.random.key(2)).astype(dtype)
    if layout == "transposed":  # an input whose memory is not in C order
        b = mx.random.normal((8, 5), key=mx.random.key(2)).astype(dtype).T
    mx.eval(a, b)
    picks = {3: [(0, np.array([11, 0, 4])), (1, np.array([2]))], 7: [(1, np.array([4, 4, 1]))]}
    rows = RoutedRows([a, b], picks)
    assert list(rows) == [3, 7] and len(rows) == 2 and rows.width == 8 and rows.dtype == dtype
    for e in rows:
        assert rows.count(e) == rows[e].shape[0]
        host = rows.host(e)
        assert host.flags["C_CONTIGUOUS"]
        assert np.array_equal(host, _bits(rows[e]))
        assert (
            activations.decode(activations.encode(host, activations.wire_dtype(dtype)), 8).tolist() == rows[e].tolist()
        )


def test_a_row_routed_to_several_experts_has_one_id_and_its_rows_gather_back() -> None:
    """A peer's call sends each row once (ComputeExpertsRequest.rows): ids name rows across inputs,
    and the rows gathered by id are each expert's host rows."""
    a = mx.arange(12 * 4, dtype=mx.float32).reshape(12, 4)
    b = mx.arange(5 * 4, dtype=mx.float32).reshape(5, 4) + 1000
    picks = {3: [(0, np.array([11, 0, 4])), (1, np.array([2]))], 7: [(0, np.array([4])), (1, np.array([2, 1]))]}
    rows = RoutedRows([a, b], picks)
    assert rows.row_ids(3).tolist() == [11, 0, 4, 14] and rows.row_ids(7).tolist() == [4, 14, 13]
    unique, index = np.unique(np.concatenate([rows.row_ids(3), rows.row_ids(7)]), return_inverse=True)
    assert len(unique) == 5  # rows 4 of a and 2 of b go to both experts: sent once each
    shared = rows.host_rows(unique)
    assert np.array_equal(shared[index[:4]], rows.host(3)) and np.array_equal(shared[index[4:]], rows.host(7))


def test_a_decode_steps_rows_are_grouped_by_expert_in_one_gather() -> None:
    x = mx.arange(4 * 3, dtype=mx.float32).reshape(4, 3)
    flat = np.array([5, 1, 1, 2, 5, 0, 2, 5])  # four rows, two choices each
    rows = GroupedRows(x, flat, 2)
    assert list(rows) == [0, 1, 2, 5]
    assert rows[5].tolist() == [x[0].tolist(), x[2].tolist(), x[3].tolist()]  # in the rows' order
    assert rows[1].tolist() == [x[0].tolist(), x[1].tolist()]
    for e in rows:
        assert np.array_equal(rows.host(e), np.array(rows[e]))
    assert np.array_equal(flat[rows.order], np.sort(flat))
