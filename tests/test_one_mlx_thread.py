"""One MLX thread per process: during a household generation — speculation's drafts and verify
passes, experts computed on a peer (ComputeExperts), experts fetched and decoded by the store's
workers — every MLX evaluation in this process happens on the MLX thread.

Evaluation is caught where Python can force it: `mx.eval` and `mx.async_eval`, the mx.array
methods that read values (`item`, `tolist`, `bool()`, `int()`, `float()`, `__index__`,
`__array__`) and numpy's constructors given an mx array. Both nodes live in this process (one
MLX thread for the process, as on a Mac), talk real gRPC on loopback over a LAN emulated with K3's
proportions so that the requester chooses remote execution, and run in float32 so that greedy
speculation must give exactly the plain single-node tokens."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from nodes import serving
from repos import tiny_id

from expertmesh.devtools.link_emulation import LanEmulation, LanInterceptor, k3_lan
from expertmesh.node.config import RemoteConfig, SpeculationConfig, StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.engine.speculative import Draft
from expertmesh.node.rpc.client import NodeClient, model_key
from expertmesh.node.service import NodeService
from expertmesh.v1 import node_pb2

SECRET = "one-mlx-thread"
ARCH = "kimi_k3"  # KDA's recurrent state: speculation restores and re-feeds it
REPO_ID = tiny_id(ARCH)
PROMPT = "for i in range for i in range"
TOKENS = 16
TIME_SCALE = 0.05
FORCING_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__array__")
NUMPY_CONSTRUCTORS = ("array", "asarray", "ascontiguousarray")


class Evaluations:
    """Which threads evaluated MLX arrays, and with what."""

    def __init__(self):
        self._lock = threading.Lock()
        self.by_thread: Counter[str] = Counter()
        self.kinds: dict[str, Counter[str]] = {}

    def record(self, kind: str) -> None:
        name = threading.current_thread().name
        with self._lock:
            self.by_thread[name] += 1
            self.kinds.setdefault(name, Counter())[kind] += 1

    def clear(self) -> None:
        with self._lock:
            self.by_thread.clear()
            self.kinds.clear()


@pytest.fixture
def evaluations(monkeypatch: pytest.MonkeyPatch) -> Evaluations:
    log = Evaluations()

    def recorded(kind: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            log.record(kind)
            return fn(*args, **kwargs)

        return wrapper

    for name in ("eval", "async_eval"):
        monkeypatch.setattr(mx, name, recorded(f"mx.{name}", getattr(mx, name)))
    for name in FORCING_METHODS:
        monkeypatch.setattr(mx.array, name, recorded(f"array.{name}", getattr(mx.array, name)))
    for name in NUMPY_CONSTRUCTORS:
        original = getattr(np, name)

        def constructor(obj, *args, _original=original, _kind=f"np.{name}", **kwargs):
            if isinstance(obj, mx.array):
                log.record(_kind)
            return _original(obj, *args, **kwargs)

        monkeypatch.setattr(np, name, constructor)
    return log


class _EchoDrafts(NodeService):
    """A node whose Generate drafts the context's last tokens: a proposal at every step (n-gram
    look-up finds none in a tiny model's short output), so every pass after the first verifies."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._draft = _Echo()


class _Echo:
    def propose(self, context: list[int], k: int, temp: float = 0.0, top_p: float = 1.0) -> Draft:
        return Draft(context[-k:])


def _float32(model) -> None:
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())


def test_the_instruments_see_an_evaluation_on_another_thread(evaluations: Evaluations) -> None:
    """The harness itself: an evaluation off the MLX thread is caught, whichever way it forces."""
    a = mx.array([1.0, 2.0])
    ways = [lambda: mx.eval(a + 1), lambda: (a * 2).tolist(), lambda: np.array(a), lambda: bool(a.sum() > 0)]
    for way in ways:
        worker = threading.Thread(target=way, name="not-the-mlx-thread")
        worker.start()
        worker.join()
    assert evaluations.by_thread["not-the-mlx-thread"] == len(ways)


@pytest.fixture
def homes(pulled_home, hub, tmp_path: Path) -> dict[str, Path]:
    """Pulled before the instruments go in: pulling is not the node's work."""
    return {name: pulled_home(ARCH, tmp_path / name) for name in ("peer", "me")}


def test_every_evaluation_of_a_household_generation_is_on_the_mlx_thread(
    homes: dict[str, Path], evaluations: Evaluations
) -> None:
    mlx = model_thread()
    lan = LanInterceptor(LanEmulation(bandwidth=0.0, rtt_s=0.0))  # shaped once the model is known
    peer = serving(REPO_ID, homes["peer"], SECRET, node_id="peer", interceptors=[lan])  # loaded on the MLX thread
    me = None
    try:
        mlx.call(_float32, peer.model.model)
        ids = peer.model.tokenizer.encode(PROMPT)
        expected = [t.id for t in Generator(peer.model).generate(ids, SamplingSettings(max_tokens=TOKENS))]
        loc = next(iter(peer.index.experts.values()))
        lan.lan = k3_lan(loc.nbytes, peer.model.blocks[0].input_width * 4, TIME_SCALE)
        me = serving(
            REPO_ID,
            homes["me"],
            SECRET,
            node_id="me",
            peers=[peer.rpc.address],
            store=StoreConfig(prefetch=False, disk_budget="0", ram_budget="0"),
            speculation=SpeculationConfig(mode="ngram", warmup_rounds=1000),  # never switched off
            service_class=_EchoDrafts,
            remote=RemoteConfig(deadline_floor_s=30.0),  # slow under instruments: no fallback by deadline
        )
        mlx.call(_float32, me.model.model)
        before = me.store.stats.snapshot()
        request = node_pb2.GenerateRequest(model=model_key(me.repo_id, me.commit), prompt=PROMPT, max_tokens=TOKENS)
        with NodeClient(me.rpc.address, SECRET) as client:  # Generate on a gRPC worker of `me`
            events = list(client.generate(request, timeout=300))
        tokens = [e.token.id for e in events if e.HasField("token")]
        done = events[-1].done
        used = me.store.stats.since(before)
    finally:
        if me is not None:
            me.close()
        peer.close()

    assert tokens == expected  # speculation and remote execution changed nothing
    assert done.drafted_tokens > 0, "speculation drafted and verified"
    assert used.uses["remote"] > 0 and used.remote["calls"] > 0, "the peer computed experts (ComputeExperts)"
    assert used.uses["hub"] + used.uses["peer"] > 0, "fetch workers decoded experts"
    assert evaluations.by_thread, "nothing was evaluated: the instruments are not in place"
    off = {name: dict(kinds) for name, kinds in evaluations.kinds.items() if name != mlx.name}
    assert not off, f"MLX evaluated off the MLX thread: {off}"
    kinds = evaluations.kinds[mlx.name]
    assert kinds["mx.eval"] and kinds["np.array"], kinds  # routing, and the experts computed here
