"""`bench --compute`'s Python calls per decode token (expertmesh/devtools/bench_compute.py): the
host's per-token work counted on the MLX thread, so a change in it shows whatever the load; work on
other threads is not the MLX thread's and is not counted. Counts are asserted, never durations."""

from __future__ import annotations

from collections.abc import Callable

from expertmesh.devtools.bench_compute import _python_calls
from expertmesh.node.engine.model_thread import model_thread

TOKENS = 6
# A token handed over a turn: the MLX thread's wait for its next turn runs a few calls of Python's
# Condition, or none when the caller queued the turn before the thread got there (the caller can
# win that race on a loaded host). What a count of a handed-over generation may be off by a token.
TURN_CALLS = 12


def _leaf() -> None:
    pass


def _step(calls: int) -> None:
    for _ in range(calls):
        _leaf()


def _one_turn(calls: int) -> Callable[[Callable[[], None]], list[int]]:
    """A generation run in one turn of the MLX thread, as mlx-lm's is: `calls` leaf calls a token."""

    def generate(tick: Callable[[], None]) -> list[int]:
        def tokens() -> list[int]:
            for _ in range(TOKENS):
                _step(calls)
                tick()
            return list(range(TOKENS))

        return model_thread().call(tokens)

    return generate


def _turn_per_token(calls: int, caller_calls: int) -> Callable[[Callable[[], None]], list[int]]:
    """A generation handed over a token a turn, as ours is: `calls` leaf calls a token on the MLX
    thread, `caller_calls` on the caller's."""

    def generate(tick: Callable[[], None]) -> list[int]:
        for _ in range(TOKENS):
            model_thread().call(_step, calls)
            _step(caller_calls)
            tick()
        return list(range(TOKENS))

    return generate


def test_each_call_a_token_makes_on_the_mlx_thread_counts_once() -> None:
    assert _python_calls(_one_turn(7)) - _python_calls(_one_turn(2)) == 5
    handed_over = _python_calls(_turn_per_token(100, 0)) - _python_calls(_turn_per_token(0, 0))
    assert abs(handed_over - 100) <= TURN_CALLS


def test_the_callers_own_calls_are_not_the_mlx_threads() -> None:
    assert abs(_python_calls(_turn_per_token(3, 100)) - _python_calls(_turn_per_token(3, 0))) <= TURN_CALLS


def test_the_counter_is_off_afterwards() -> None:
    _python_calls(_one_turn(1))
    assert model_thread().call(lambda: __import__("sys").getprofile()) is None
