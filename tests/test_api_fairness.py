"""The API's shared parts under hostile or careless clients, without a node: the request queue gives
a waiting request's place up when its client leaves, and the stop scanner's work per token stays
bounded by what is still unsent, whatever the answer's length.

Found by an adversarial audit: three clients that POST and hang up while queued kept `max_waiting`
full, so a live client got 429 until the running generation ended; a 1 MB stop string made every
token re-slice the whole answer."""

from __future__ import annotations

import random
import threading

import pytest

from expertmesh.coordinator.openai_request import MAX_STOP_CHARS, MAX_VALUES, ApiError, check_json, parse_ask
from expertmesh.coordinator.request_queue import LeftQueue, QueueFull, RequestQueue
from expertmesh.coordinator.stop_sequences import StopScanner

JOIN_S = 10  # bounds every wait below; the behaviour asserted never depends on it


def _waiter(queue: RequestQueue, cancelled: threading.Event, outcome: list) -> threading.Thread:
    def run() -> None:
        try:
            with queue.slot(cancelled=cancelled.is_set):
                outcome.append("ran")
        except LeftQueue:
            outcome.append("left")
        except QueueFull:
            outcome.append("full")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _until(predicate, limit_s: float = JOIN_S) -> bool:
    done = threading.Event()
    for _ in range(int(limit_s / 0.01)):
        if predicate():
            return True
        done.wait(0.01)
    return predicate()


def test_a_request_whose_client_left_gives_its_place_up() -> None:
    queue = RequestQueue(lambda: 1, max_waiting=2)
    with queue.slot():  # a long generation runs
        gone = [threading.Event(), threading.Event()]
        outcomes: list[list] = [[], []]
        threads = [_waiter(queue, gone[i], outcomes[i]) for i in range(2)]
        assert _until(lambda: queue.depth() == (1, 2))
        with pytest.raises(QueueFull):  # the queue is full while both are there
            with queue.slot():
                pass
        gone[0].set()  # its client hung up
        threads[0].join(JOIN_S)
        assert outcomes[0] == ["left"] and queue.depth() == (1, 1)
        live: list = []
        third = _waiter(queue, threading.Event(), live)  # a live client now gets the freed place
        assert _until(lambda: queue.depth() == (1, 2))
    threads[1].join(JOIN_S)
    third.join(JOIN_S)
    assert outcomes[1] == ["ran"] and live == ["ran"]
    assert queue.depth() == (0, 0)


def test_slots_that_appear_are_taken_without_a_wake_up() -> None:
    """A full node that joins adds slots; nothing notifies the queue, so waiters look again."""
    slots = [1]
    queue = RequestQueue(lambda: slots[0], max_waiting=4)
    outcome: list = []
    with queue.slot():
        t = _waiter(queue, threading.Event(), outcome)
        assert _until(lambda: queue.depth() == (1, 1))
        slots[0] = 2
        t.join(JOIN_S)
        assert outcome == ["ran"]


def _reference_cut(pieces: list[str], stops: list[str]) -> str:
    """Generation stops at the first piece after which the text holds a stop; the answer is the
    text before the earliest stop found then (a longer stop not yet complete does not count)."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)]
    return text


@pytest.mark.parametrize("seed", range(5))
def test_the_stop_scanner_sends_exactly_the_text_before_the_first_stop(seed: int) -> None:
    """Random pieces over a small alphabet, so stops straddle pieces and prefixes are held back."""
    rng = random.Random(seed)
    for _ in range(400):
        stops = ["".join(rng.choice("ab~") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        pieces = ["".join(rng.choice("ab~c") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 12))]
        scanner = StopScanner(stops)
        sent = "".join(scanner.feed(p) for p in pieces) + scanner.finish()
        assert sent == _reference_cut(pieces, stops), (stops, pieces)


def test_a_long_held_back_tail_is_never_rescanned_from_the_answers_start() -> None:
    """Text already sent cannot start a stop, so it is never looked at again: with a stop of
    MAX_STOP_CHARS the scanner holds back at most that much, and the sent text stays exact."""
    stop = "~" * MAX_STOP_CHARS
    scanner = StopScanner([stop])
    looked: list[int] = []

    class Watched(str):
        def startswith(self, prefix, *args):  # how much of the answer each check looks at
            looked.append(len(prefix))
            return str.startswith(self, prefix, *args)

    scanner.stops = [Watched(stop)]
    answer = ("word " * 2000) + "~" * (MAX_STOP_CHARS - 1)
    out = "".join(scanner.feed(answer[i : i + 7]) for i in range(0, len(answer), 7))
    assert out == "word " * 2000  # the tildes may yet become the stop: held back
    assert max(looked) <= MAX_STOP_CHARS - 1
    # each feed looks at its unsent text only: about one check per character, not one per
    # character of the stop for every token (730,000 checks here before the fix)
    assert len(looked) <= 2 * len(answer), len(looked)
    assert scanner.finish() == "~" * (MAX_STOP_CHARS - 1)


def test_a_stop_longer_than_the_limit_is_a_400() -> None:
    body = {"model": "m", "prompt": "hi", "stop": "~" * (MAX_STOP_CHARS + 1)}
    with pytest.raises(ApiError, match="at most") as e:
        parse_ask(body, False, ["m"], 16)
    assert e.value.param == "stop"
    assert parse_ask({**body, "stop": "~" * MAX_STOP_CHARS}, False, ["m"], 16).stop


def test_a_body_of_too_many_values_is_refused_before_it_is_walked_twice() -> None:
    with pytest.raises(ApiError, match="values"):
        check_json({"pad": [0] * MAX_VALUES})
    check_json({"pad": [0] * (MAX_VALUES // 2)})
