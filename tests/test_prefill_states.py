"""ChunkEndStates (node/engine/prefill_states.py) on mlx-lm's own caches, driven as a layer-major
prefill drives them: a chunk's state is each cache as that chunk's turn left it, and a change it
cannot attribute to the chunk leaves the checkpoint out instead of storing a wrong state."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from expertmesh.node.engine.prefill_states import ChunkEndStates


def _write(layer, n: int, value: float) -> None:
    if isinstance(layer, KVCache):
        layer.update_and_fetch(mx.full((1, 1, n, 2), value), mx.full((1, 1, n, 2), value))
    else:
        layer[0] = mx.full((1, 2), value)  # a recurrent state is replaced, as KDA's is


def test_each_layer_is_taken_as_the_watched_chunk_left_it() -> None:
    cache = [KVCache(), ArraysCache(1)]
    states = ChunkEndStates(cache, {0})
    for layer in cache:  # layer-major: both chunks pass a layer before either reaches the next
        for chunk, (n, value) in enumerate(((3, 1.0), (2, 2.0))):
            states.before_turn(chunk)
            _write(layer, n, value)
            states.after_turn(chunk)
    kv, recurrent = states.states()[0]
    # the second chunk wrote its rows into the same buffer in place: the state taken does not see them
    assert kv.offset == 3 and mx.array_equal(
        kv.keys[..., :5, :], mx.concatenate([mx.full((1, 1, 3, 2), 1.0), mx.zeros((1, 1, 2, 2))], 2)
    )
    assert mx.array_equal(recurrent[0], mx.full((1, 2), 1.0))
    assert cache[0].offset == 5 and mx.array_equal(cache[1][0], mx.full((1, 2), 2.0))  # the live cache went on


def test_a_change_outside_the_watched_chunks_turns_leaves_its_checkpoint_out() -> None:
    cache = [ArraysCache(1)]
    states = ChunkEndStates(cache, {0})
    states.before_turn(0)
    states.after_turn(0)  # the chunk's turn changed nothing that can be seen
    _write(cache[0], 1, 5.0)
    assert states.states() == {}
