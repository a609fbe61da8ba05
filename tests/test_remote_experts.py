"""Remote expert execution between real nodes on loopback: a requester that holds no experts sends
activations to a compute peer that holds them, over a LAN emulated with K3's proportions (so
fetching an expert costs what it costs K3 and the cost model has a real choice to make).

Tolerance: a remotely computed expert must equal the local computation to within 1e-6 relative
(float32) — in practice the bits are identical, since both sides run the same kernels on the
same rows in the same batch; greedy tokens must be identical."""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
import weakref
from pathlib import Path

import grpc
import mlx.core as mx
import numpy as np
import pytest
from nodes import joined, serving
from repos import KIMI_K3, tiny_id
from waiting import wait_until

from expertmesh.devtools.link_emulation import LanEmulation, LanInterceptor, k3_lan
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import ARCHS
from expertmesh.node.config import RemoteConfig, StoreConfig
from expertmesh.node.engine.core_quantization import quantize_core
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.household.expert_compute import MAX_ROWS_PER_CALL
from expertmesh.node.household.remote_experts import PING_DEADLINE_S, LinkEstimate, RemoteExperts
from expertmesh.node.hub import local_models
from expertmesh.node.hub.pull import pull
from expertmesh.node.rpc import activations
from expertmesh.node.rpc.auth import call_metadata, node_method
from expertmesh.node.service import NodeService
from expertmesh.v1 import node_pb2, node_pb2_grpc
from tests.store_calls import compute_here

SECRET = "remote-test-secret"
PROMPT = "Move activations, not experts"
TOKENS = 10
TIME_SCALE = 0.05  # a K3 expert's 148 ms on gigabit becomes 7.4 ms
ROW_S = 0.001  # a peer's seconds per row it computes, where its compute grows with its rows
SLOW_PING_S = 0.3  # a ping answered this late is a spell at the peer, not its link
PROMPT_ROWS = 4  # rows per expert above which a call carries a prompt's rows (decode's carry one or two)


def _generate(node, on_token=None) -> list[int]:
    sm, out = node.model, []
    for t in Generator(sm).generate(sm.tokenizer.encode(PROMPT), SamplingSettings(max_tokens=TOKENS)):
        out.append(t.id)
        if on_token is not None:
            on_token(len(out))
    return out


class _ComputeNode(NodeService):
    """A compute peer whose ComputeExperts can be made to misbehave (`mode`)."""

    mode = "honest"
    asked_as_owner = 0  # calls with fetch_on_miss that "all_missing" answered
    older = False  # its Info says nothing of shared rows, as a node from before them
    recorded: list[node_pb2.ComputeExpertsRequest] | None = None  # requests as they arrived, when a list

    def Info(self, request, context):
        if self.mode == "slow_ping":  # a busy spell: this one answer comes late
            self.mode = "honest"
            time.sleep(SLOW_PING_S)
        if self.mode == "silent_ping":  # computes, but lets every Info ping run out
            time.sleep(PING_DEADLINE_S + 0.5)
        info = super().Info(request, context)
        if self.older:
            info.shared_rows = False
        return info

    def ComputeExperts(self, request, context):
        if self.recorded is not None:
            self.recorded.append(node_pb2.ComputeExpertsRequest.FromString(request.SerializeToString()))
        if self.mode == "slow":
            time.sleep(2.0)
        if self.mode == "all_missing":  # says it holds nothing, and fetches nothing even as the owner
            self.asked_as_owner += request.fetch_on_miss
            return node_pb2.ComputeExpertsResponse(missing=[x.expert for x in request.experts])
        rows = sum(len(x.row_index) or (x.rows.shape[0] if x.rows.shape else 0) for x in request.experts)
        prompt = rows > PROMPT_ROWS * len(request.experts)
        if self.mode == "lies_after_one_call":  # its first answer is honest, every later one NaN
            self.mode = "nan"
            return super().ComputeExperts(request, context)
        if prompt and self.mode in ("busy_prompt", "stuck_prompts"):  # answers just past the deadline
            if self.mode == "busy_prompt":
                self.mode = "honest"  # a busy spell: its next calls are answered in time
            time.sleep(context.time_remaining() + 0.1)
        response = super().ComputeExperts(request, context)
        if self.mode == "honest" or not response.experts:
            return response
        first = response.experts[0]
        t = first.rows
        if self.mode == "short":  # one row too few
            width = t.shape[1]
            first.rows.CopyFrom(
                node_pb2.Tensor(
                    shape=[t.shape[0] - 1, width] if t.shape[0] > 1 else [1, width - 1],
                    dtype=t.dtype,
                    data=t.data[: -len(t.data) // t.shape[0]],
                )
            )
        elif self.mode == "nan":
            nan = mx.full((t.shape[0], t.shape[1]), float("nan"), dtype=activations.DTYPES[t.dtype][0])
            first.rows.CopyFrom(activations.encode(nan))  # in the dtype asked: caught as NaN, not as a dtype
        elif self.mode == "wrong_values":  # every answer well formed, finite and wrong: scaled by 1.5
            for item in response.experts:
                x = activations.decode(item.rows, item.rows.shape[1])
                item.rows.CopyFrom(activations.encode(x * 1.5))
        elif self.mode == "extra":
            response.experts.append(node_pb2.ExpertRows(expert=first.expert, rows=t))
        elif self.mode == "missing_twice":  # one expert said missing twice: counted twice, were it taken
            e = first.expert
            del response.experts[0]
            response.missing.extend([e, e])
        return response


class Pair:
    """A compute peer that holds what PROMPT routes to, and a requester that holds nothing."""

    def __init__(self, arch: str, root: Path):
        repo = tiny_id(arch)
        pull(repo, home=root / "peer", progress=False)
        lan = LanInterceptor(LanEmulation(bandwidth=0.0, rtt_s=0.0))  # shaped below, once the model is known
        self.peer = serving(
            repo, root / "peer", SECRET, node_id=f"peer-{arch}", service_class=_ComputeNode, interceptors=[lan]
        )
        self.expected = _generate(self.peer)  # the single-node output; it also fills the peer's disk
        loc = next(iter(self.peer.index.experts.values()))
        row_bytes = self.peer.model.blocks[0].input_width * 4
        lan.lan = k3_lan(loc.nbytes, row_bytes, TIME_SCALE)
        self.service = self.peer.service
        self.running = self.peer.rpc
        self.running_id = f"peer-{arch}"
        pull(repo, home=root / "me", progress=False)
        self.me = joined(
            repo,
            root / "me",
            SECRET,
            [self.running.address],
            node_id=f"me-{arch}",
            store=StoreConfig(prefetch=False, disk_budget="0", ram_budget="0"),
            remote=RemoteConfig(deadline_floor_s=0.5),
        )
        self.source = self.me.peer_tier
        self.remote = self.me.remote
        # the compute audit's fetches are uses the store's bookkeeping tests count: on only where a
        # test turns it on (`audited`)
        self.audit, self.remote.audit = self.remote.audit, None

    def revive(self) -> None:
        """The pair as new: an honest peer, not skipped, its link not yet measured (what a test
        taught the requester of a misbehaving peer is no part of the next test)."""
        self.service.mode, self.service.older, self.service.recorded = "honest", False, None
        self.remote.links.clear()
        for p in self.source.table.peers.values():
            p.skip_until = 0.0
        self.source.table.distrusted.clear()
        self.remote.audit = None
        self.audit.forget(self.running_id)  # its next answer is audited as its first

    def audited(self) -> None:
        """This test's calls are audited as the node's are (household/compute_audit.py)."""
        self.remote.audit = self.audit

    def close(self) -> None:
        self.me.close()
        self.peer.close()


@pytest.fixture(scope="module")
def pairs(hub: HubServer, tmp_path_factory: pytest.TempPathFactory):
    made: dict[str, Pair] = {}

    def get(arch: str) -> Pair:
        if arch not in made:
            made[arch] = Pair(arch, tmp_path_factory.mktemp(f"remote-{arch}"))
        made[arch].revive()
        return made[arch]

    yield get
    for p in made.values():
        p.close()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_remote_execution_gives_the_single_node_output(pairs, arch: str) -> None:
    pair = pairs(arch)
    before = pair.me.store.stats.snapshot()
    assert _generate(pair.me) == pair.expected
    d = pair.me.store.stats.since(before)
    assert d.uses["remote"] > 0, d.uses  # the cost model sent experts to the peer that holds them
    assert d.remote["calls"] > 0 and d.remote["sent_bytes"] > 0
    # a token's row goes once to the peer, which computes several of its experts; an answer per expert
    assert d.remote["sent_bytes"] < d.remote["received_bytes"]
    assert d.remote["fallback_error"] == d.remote["fallback_bad_output"] == 0


def test_one_late_ping_does_not_keep_a_peer_from_computing(pairs) -> None:
    """The round trip is measured by pinging the peer, and a call's fixed cost is reckoned from it
    until calls are seen. One ping that a busy moment delayed (a GC pause, a loaded core) is not
    the link: were it taken as the round trip, every expert would look cheaper to fetch than to
    send rows for, until the next ping half a minute later. The link is judged by its quickest
    of several pings."""
    pair = pairs("kimi_k3")
    pair.service.mode = "slow_ping"
    before = pair.me.store.stats.snapshot()
    assert _generate(pair.me) == pair.expected
    d = pair.me.store.stats.since(before)
    assert pair.service.mode == "honest", "the requester pinged the peer"
    assert d.remote["calls"] > 0 and d.uses["remote"] > 0, (d.remote, d.uses)
    assert next(iter(pair.remote.links.values())).rtt_s < SLOW_PING_S / 2


def test_a_peer_whose_ping_runs_out_is_skipped(pairs) -> None:
    """The ping is made on the MLX thread: a peer that computes but never answers it used to cost
    each token its whole deadline every half minute, and was never skipped."""
    pair = pairs("kimi_k3")
    pair.service.mode = "silent_ping"
    for link in pair.remote.links.values():
        link.pinged_at = -1e9  # due again
    assert _generate(pair.me) == pair.expected
    assert pair.source.table.errors["ping_deadline_exceeded"] == 1
    assert pair.source.table.live_count() == 0  # skipped for a while; its experts are fetched here


def _held_request(pair: Pair) -> tuple[list[int], dict[int, mx.array], node_pb2.ComputeExpertsRequest]:
    """A ComputeExperts request for up to three experts of the first MoE layer the peer holds."""
    block = pair.me.model.blocks[0]
    layer = block.layer
    held = sorted(e for (lay, e) in pair.peer.index.experts if lay == layer and (lay, e) in pair.peer.disk)[:3]
    assert held, "the peer holds experts of the first MoE layer after generating"
    rng = np.random.default_rng(0)
    rows = {e: mx.array(rng.standard_normal((n, block.input_width)).astype(np.float32)) for n, e in enumerate(held, 1)}
    request = node_pb2.ComputeExpertsRequest(
        model=node_pb2.ModelKey(repo_id=pair.me.repo_id, commit=pair.me.commit),
        layer=layer,
        experts=[node_pb2.ExpertRows(expert=e, rows=activations.encode(r)) for e, r in rows.items()],
    )
    return held, rows, request


def _compute(pair: Pair, request: node_pb2.ComputeExpertsRequest) -> node_pb2.ComputeExpertsResponse:
    with grpc.insecure_channel(f"127.0.0.1:{pair.running.port}") as channel:
        return node_pb2_grpc.NodeStub(channel).ComputeExperts(
            request, metadata=call_metadata(SECRET, node_method("ComputeExperts")), timeout=30
        )


def test_a_remote_expert_equals_the_local_computation(pairs) -> None:
    pair = pairs("kimi_k3")
    block = pair.me.model.blocks[0]
    held, rows, request = _held_request(pair)
    response = _compute(pair, request)
    assert [x.expert for x in response.experts] == held and not response.missing
    local = compute_here(block, pair.me.store, held, rows)
    for x in response.experts:
        remote = np.array(activations.decode(x.rows, block.output_dims, rows=rows[x.expert].shape[0]))
        np.testing.assert_allclose(remote, np.array(local[x.expert]), rtol=1e-6, atol=1e-7)


def _watch_store(store, handed: list[int], judged: list[set[int]]):
    """Record the size of each group the store hands over and each routing that judges guesses."""
    groups, judge = store.layer_groups, store.prefetcher.judge_guesses

    def layer_groups(layer, experts, **kw):
        for group in groups(layer, experts, **kw):
            handed.append(len(group.served))
            yield group

    def judging(layer, demanded):
        judged.append(set(demanded))
        return judge(layer, demanded)

    store.layer_groups, store.prefetcher.judge_guesses = layer_groups, judging


@pytest.mark.parametrize("peer", ["honest", "nan"])
def test_remote_execution_asks_the_store_as_a_local_pass_does(pairs, peer: str) -> None:
    """Remote execution goes through the store's one entry point. The whole routing of a pass,
    experts computed on the peer included, judges the guesses made for the layer; and the
    experts of a long prompt that run here (all of them, once the peer answers garbage) come in
    groups within the hold limit."""
    pair = pairs("kimi_k3")
    pair.service.mode = peer
    store, sm = pair.me.store, pair.me.model
    handed: list[int] = []
    judged: list[set[int]] = []
    before = store.stats.snapshot()
    _watch_store(store, handed, judged)
    try:
        ids = sm.tokenizer.encode(PROMPT * 6)
        list(Generator(sm).generate(ids, SamplingSettings(max_tokens=2)))
    finally:
        del store.layer_groups, store.prefetcher.judge_guesses
    d = store.stats.since(before)
    assert sum(len(j) for j in judged) == d.total_uses  # every routed expert judged, wherever it ran
    if peer == "honest":
        assert d.uses["remote"] > 0
    else:
        limit = store.hold_limit()
        assert d.remote["fallback_bad_output"] > 0 and d.uses["remote"] == 0
        assert max(handed) <= limit < max(len(j) for j in judged)  # a layer wanted more: in groups


def test_a_peer_reports_its_wait_for_the_mlx_thread_apart_from_its_compute(pairs) -> None:
    """A peer whose MLX thread is busy (its own generation) makes a call wait; that wait is
    reported apart, so the caller's per-expert service time stays what the experts cost."""
    pair = pairs("kimi_k3")
    _held, _rows, request = _held_request(pair)
    alone = _compute(pair, request)
    computer, release, hogging = pair.service.computer, threading.Event(), threading.Event()

    def hog() -> None:  # stands for a generation step on the MLX thread
        hogging.set()
        release.wait(10)

    hogger = threading.Thread(target=lambda: model_thread().call(hog), daemon=True)
    hogger.start()
    assert hogging.wait(10)
    caller = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pending = caller.submit(_compute, pair, request)
        assert wait_until(lambda: computer._running == 1), "the call never reached the peer"
        time.sleep(0.2)  # the call now waits for the MLX thread
        release.set()
        busy = pending.result(timeout=30)
    finally:
        release.set()
        caller.shutdown()
        hogger.join(10)
    assert 0 < busy.mlx_wait_seconds <= busy.compute_seconds
    assert busy.mlx_wait_seconds > alone.mlx_wait_seconds
    link = LinkEstimate()
    link.observe_call(busy.compute_seconds + 0.01, busy.compute_seconds, len(busy.experts), 0, busy.mlx_wait_seconds)
    assert link.service_s == pytest.approx((busy.compute_seconds - busy.mlx_wait_seconds) / len(busy.experts))
    assert link.mlx_wait_s > 0  # the expected wait goes into the call's start instead


def test_a_lying_mlx_wait_is_held_to_what_the_caller_saw() -> None:
    link = LinkEstimate()
    link.observe_call(1.0, 0.5, 2, 0, float("nan"))
    assert link.service_s == pytest.approx(0.25) and link.mlx_wait_s == 0
    link = LinkEstimate()
    link.observe_call(1.0, 0.5, 2, 0, 1e9)  # more than the peer's own total: at most all of it
    assert link.service_s == 0 and link.mlx_wait_s == pytest.approx(0.5 * 0.2)


def test_a_missed_deadline_is_a_lower_bound_on_what_a_prompts_call_takes() -> None:
    link = LinkEstimate(service_s=0.01, service_rows=1.0)
    assert link.rows_factor(8.0) == 8.0 and link.rows_factor(1.0) == 1.0
    link.observe_prompt_call(2.0, 0.5, answered=False)  # took at least 4x what the rows' growth says
    assert link.prompt_scale == 4.0 and link.rows_factor(8.0) == 32.0
    assert link.rows_factor(1.0) == 1.0  # decode's deadlines are not prompts'
    link.observe_prompt_call(1.0, 0.5, answered=False)  # a shorter deadline missed says less: kept
    assert link.prompt_scale == 4.0
    link.observe_prompt_call(0.5, 0.5, answered=True)  # answered as the rows' growth says: back towards 1
    assert 1.0 < link.prompt_scale < 4.0


@pytest.mark.parametrize("mode", ["short", "nan", "extra", "missing_twice"])
def test_a_peer_with_malformed_outputs_is_caught_skipped_and_counted(pairs, mode: str) -> None:
    pair = pairs("kimi_k3")
    pair.service.mode = mode
    before, errors = pair.me.store.stats.snapshot(), pair.source.table.errors["bad_output"]
    assert _generate(pair.me) == pair.expected  # every bad answer was computed here instead
    d = pair.me.store.stats.since(before)
    assert d.remote["fallback_bad_output"] > 0
    assert pair.source.table.errors["bad_output"] > errors
    assert pair.source.table.live_count() == 0  # skipped for a while after lying


def test_a_peer_whose_answers_are_wrong_is_caught_by_the_audit_of_its_first(pairs) -> None:
    """Well formed, finite and wrong, its answers pass every check of their form: computing its
    first again here shows it, and the peer is asked for nothing more."""
    pair = pairs("kimi_k3")
    pair.audited()
    pair.service.mode = "wrong_values"
    stats = pair.me.store.stats
    before = stats.snapshot()
    _generate(pair.me)  # its first answers are used: the audit stops the harm, it does not undo it
    assert wait_until(lambda: stats.since(before).compute_audits["wrong"] == 1, timeout_s=30)
    assert pair.source.table.errors["lied"] >= 1 and pair.source.table.live_count() == 0
    remote = stats.since(before).remote["calls"]
    assert _generate(pair.me) == pair.expected  # computed here from now on
    assert stats.since(before).remote["calls"] == remote


def test_an_honest_peers_first_answer_is_confirmed(pairs) -> None:
    pair = pairs("kimi_k3")
    pair.audited()
    stats = pair.me.store.stats
    before = stats.snapshot()
    assert _generate(pair.me) == pair.expected
    assert wait_until(lambda: stats.since(before).compute_audits["confirmed"] >= 1, timeout_s=30)
    assert stats.since(before).compute_audits["wrong"] == 0 and pair.source.table.live_count() == 1


def test_a_slow_peer_is_cut_off_at_the_deadline(pairs) -> None:
    pair = pairs("kimi_k3")
    pair.service.mode = "slow"
    before = pair.me.store.stats.snapshot()
    assert _generate(pair.me) == pair.expected
    assert pair.me.store.stats.since(before).remote["fallback_deadline"] > 0


def test_an_owner_that_answers_missing_what_it_was_asked_to_fetch_is_skipped(pairs) -> None:
    """Asked as the owner (`fetch_on_miss`), an honest peer fetches what it lacks and computes it:
    it never answers an expert missing. One that does was asked again at every layer of every
    token, each time a round trip before the experts were computed here, and never skipped."""
    pair = pairs("kimi_k3")
    pair.service.mode, pair.service.asked_as_owner = "all_missing", 0
    before = pair.me.store.stats.snapshot()
    assert _generate(pair.me) == pair.expected  # everything computed here instead
    assert pair.me.store.stats.since(before).remote["fallback_missing"] > 0
    assert pair.service.asked_as_owner > 0
    assert pair.source.table.errors["owner_missing"] > 0
    assert pair.source.table.live_count() == 0  # skipped for a while
    asked = pair.service.asked_as_owner
    assert _generate(pair.me) == pair.expected
    assert pair.service.asked_as_owner == asked  # and not asked again meanwhile


def test_a_compute_peer_killed_mid_generation_loses_no_token(hub: HubServer, tmp_path: Path) -> None:
    pair = Pair("kimi_k3", tmp_path)
    try:
        stopped = []

        def kill_after_three(n: int) -> None:
            if n == 3:
                pair.running.stop(0)
                stopped.append(pair.me.store.stats.snapshot())

        assert _generate(pair.me, kill_after_three) == pair.expected
        assert stopped and stopped[0].uses["remote"] > 0  # it was computing remotely before the kill
        d = pair.me.store.stats.since(stopped[0])
        assert d.uses["hub"] > 0  # after it: fetched from the Hub, and the tokens did not change
    finally:
        pair.me.close()
        pair.peer.close()


def test_compute_requests_are_checked(pairs) -> None:
    pair = pairs("kimi_k3")
    block = pair.me.model.blocks[0]
    model = node_pb2.ModelKey(repo_id=pair.me.repo_id, commit=pair.me.commit)
    good = activations.encode(mx.zeros((2, block.input_width)))
    bad_requests = {
        "no such layer": node_pb2.ComputeExpertsRequest(
            model=model, layer=10_000, experts=[node_pb2.ExpertRows(expert=0, rows=good)]
        ),
        "wrong width": node_pb2.ComputeExpertsRequest(
            model=model,
            layer=block.layer,
            experts=[node_pb2.ExpertRows(expert=0, rows=activations.encode(mx.zeros((2, block.input_width + 1))))],
        ),
        "short data": node_pb2.ComputeExpertsRequest(
            model=model,
            layer=block.layer,
            experts=[
                node_pb2.ExpertRows(
                    expert=0, rows=node_pb2.Tensor(shape=good.shape, dtype=good.dtype, data=good.data[:-1])
                )
            ],
        ),
        "an expert twice": node_pb2.ComputeExpertsRequest(
            model=model, layer=block.layer, experts=[node_pb2.ExpertRows(expert=0, rows=good)] * 2
        ),
        "unknown dtype": node_pb2.ComputeExpertsRequest(
            model=model,
            layer=block.layer,
            experts=[
                node_pb2.ExpertRows(expert=0, rows=node_pb2.Tensor(shape=good.shape, dtype="int8", data=good.data))
            ],
        ),
        "a shared row index past the rows": node_pb2.ComputeExpertsRequest(
            model=model, layer=block.layer, rows=good, experts=[node_pb2.ExpertRows(expert=0, row_index=[0, 2])]
        ),
        "shared rows and rows of its own": node_pb2.ComputeExpertsRequest(
            model=model, layer=block.layer, rows=good, experts=[node_pb2.ExpertRows(expert=0, rows=good, row_index=[0])]
        ),
        "shared rows, none named": node_pb2.ComputeExpertsRequest(
            model=model, layer=block.layer, rows=good, experts=[node_pb2.ExpertRows(expert=0)]
        ),
        "shared rows of the wrong width": node_pb2.ComputeExpertsRequest(
            model=model,
            layer=block.layer,
            rows=activations.encode(mx.zeros((2, block.input_width + 1))),
            experts=[node_pb2.ExpertRows(expert=0, row_index=[0])],
        ),
        # each index makes a row: refused before one is copied
        "more shared rows named than a call may hold": node_pb2.ComputeExpertsRequest(
            model=model,
            layer=block.layer,
            rows=good,
            experts=[node_pb2.ExpertRows(expert=0, row_index=[0] * (MAX_ROWS_PER_CALL + 1))],
        ),
        # quoted whole in the error, it made a trailer past gRPC's metadata limit: RESOURCE_EXHAUSTED
        "a long unknown dtype": node_pb2.ComputeExpertsRequest(
            model=model,
            layer=block.layer,
            experts=[
                node_pb2.ExpertRows(expert=0, rows=node_pb2.Tensor(shape=good.shape, dtype="x" * 65536, data=good.data))
            ],
        ),
    }
    with grpc.insecure_channel(f"127.0.0.1:{pair.running.port}") as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        for what, request in bad_requests.items():
            with pytest.raises(grpc.RpcError) as e:
                stub.ComputeExperts(request, metadata=call_metadata(SECRET, node_method("ComputeExperts")), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
        ok = node_pb2.ComputeExpertsRequest(
            model=model, layer=block.layer, experts=[node_pb2.ExpertRows(expert=0, rows=good)]
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.ComputeExperts(ok, timeout=10)  # no secret
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        other = node_pb2.ComputeExpertsRequest(
            model=node_pb2.ModelKey(repo_id=model.repo_id, commit="0" * 40), layer=block.layer, experts=ok.experts
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.ComputeExperts(other, metadata=call_metadata(SECRET, node_method("ComputeExperts")), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        info = stub.Info(node_pb2.InfoRequest(), metadata=call_metadata(SECRET, node_method("Info")), timeout=10)
        assert info.compute and info.role == "full" and info.shared_rows
        # the same rows, shared: each expert named by index answers what its own rows did
        own = node_pb2.ComputeExpertsRequest(
            model=model, layer=block.layer, experts=[node_pb2.ExpertRows(expert=0, rows=good)]
        )
        shared = node_pb2.ComputeExpertsRequest(
            model=model, layer=block.layer, rows=good, experts=[node_pb2.ExpertRows(expert=0, row_index=[0, 1])]
        )
        answers = [
            stub.ComputeExperts(r, metadata=call_metadata(SECRET, node_method("ComputeExperts")), timeout=10)
            for r in (own, shared)
        ]
        assert answers[0].experts == answers[1].experts


def test_a_peer_that_does_not_take_shared_rows_is_sent_each_experts_rows(pairs) -> None:
    pair = pairs("kimi_k3")
    pair.service.older, pair.service.recorded = True, []
    try:
        before = pair.me.store.stats.snapshot()
        assert _generate(pair.me) == pair.expected
        d = pair.me.store.stats.since(before)
        sent = pair.service.recorded
    finally:
        pair.service.older, pair.service.recorded = False, None
    assert sent and not any(r.HasField("rows") or any(x.row_index for x in r.experts) for r in sent)
    assert d.remote["sent_bytes"] == d.remote["received_bytes"]  # each expert's rows in full, as before


def test_placement_follows_the_measured_costs(pairs) -> None:
    """K3 on gigabit: an expert takes 148 ms to cross, the peer computes one in 5 ms. An expert on
    the local disk is read here; one held by the peer runs there; a peer slower than the link gets
    nothing."""
    pair = pairs("kimi_k3")
    layer = pair.me.model.blocks[0].layer
    experts = sorted(e for (lay, e) in pair.peer.index.experts if lay == layer and (lay, e) in pair.peer.disk)[:4]
    assert len(experts) == 4
    nbytes = pair.me.index.expert(layer, experts[0]).nbytes
    observer = pair.source.transfer_observer
    try:
        remote = RemoteExperts(pair.me.store, pair.source, disk={(layer, experts[0])})
        peer = next(iter(pair.source.table.peers.values()))
        remote.links[peer.node_id] = link = LinkEstimate(
            rtt_s=1e-3, measured_bandwidth=nbytes / 0.148, call_s=1.2e-3, service_s=5e-3, pinged_at=time.monotonic()
        )
        rows = dict.fromkeys(experts, 256)
        plan = remote.plan(layer, experts, rows)
        assert experts[0] not in plan.remote
        assert all(plan.remote.get(e) is peer for e in experts[1:])
        # rows past one call's size limit (a long prompt's) go all the same, split over calls
        huge = remote.plan(layer, experts, dict.fromkeys(experts, remote.config.max_call_bytes + 1))
        assert all(huge.remote.get(e) is peer for e in experts[1:])
        link.service_s = 1.0
        assert not remote.plan(layer, experts, rows).remote
    finally:
        pair.source.transfer_observer = observer


def test_run_with_peers_computes_remotely_unless_told_not_to(pulled_home, pairs, tmp_path: Path, monkeypatch) -> None:
    """The CLI's wiring: `--peer` attaches remote execution (a compute peer was described as one);
    `--remote-compute off` leaves every expert to be fetched."""
    from expertmesh.assembly import build_node
    from expertmesh.cli import build_parser
    from expertmesh.cli.generate import node_config

    pair = pairs("kimi_k3")
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path))
    monkeypatch.setenv("EXPERTMESH_SECRET", SECRET)
    pulled_home("kimi_k3", tmp_path)
    for flag, bound in (("auto", True), ("off", False)):
        args = build_parser().parse_args(
            ["run", pair.me.repo_id, "hello", "--peer", f"127.0.0.1:{pair.running.port}", "--remote-compute", flag]
        )
        with build_node(node_config(args)) as node:
            assert all(p.compute for p in node.peers.all())  # Info said so
            assert all((b._remote is not None) == bound for b in node.model.blocks), flag


def test_nodes_with_different_core_bits_serve_each_others_experts(hub: HubServer, oracle, tmp_path: Path) -> None:
    """A peer that runs a 4-bit core (`pull --core-bits 4`) holds the same expert bytes as one that
    runs the BF16 core: a BF16 node fetches them from it, or has it compute them (ComputeExperts),
    and generates exactly its single-node tokens (mlx-lm's, on the BF16 core)."""
    repo = KIMI_K3
    pull(repo, home=tmp_path / "peer", progress=False)
    quantize_core(local_models.find_pulled(tmp_path / "peer", repo), 4)
    lan = LanInterceptor(LanEmulation(bandwidth=0.0, rtt_s=0.0))
    peer = serving(repo, tmp_path / "peer", SECRET, node_id="peer-q4", interceptors=[lan])
    try:
        assert peer.model.core_bits == 4
        _generate(peer)  # its own tokens (another core's): the experts they route to land on its disk
        loc = next(iter(peer.index.experts.values()))
        lan.lan = k3_lan(loc.nbytes, peer.model.blocks[0].input_width * 4, TIME_SCALE)
        pull(repo, home=tmp_path / "me", progress=False)
        expected = oracle.tokens("kimi_k3", PROMPT, TOKENS)
        store = StoreConfig(prefetch=False, disk_budget="0", ram_budget="0")
        for remote, source in ((None, "peer"), (RemoteConfig(deadline_floor_s=0.5), "remote")):
            me = joined(repo, tmp_path / "me", SECRET, [peer.rpc.address], node_id=f"me-{source}", store=store,
                        remote=remote)  # fmt: skip
            try:
                assert me.model.core_bits == 16
                before = me.store.stats.snapshot()
                assert _generate(me) == expected, f"experts by {source}"
                assert me.store.stats.since(before).uses[source] > 0
            finally:
                me.close()
    finally:
        peer.close()


def test_a_prompt_of_several_chunks_sends_a_peer_one_call_a_layer(pairs, oracle, monkeypatch) -> None:
    """Layer-major prefill (node/engine/prefill.py): each MoE layer hands the peer every chunk's
    rows of its experts in one ComputeExperts call, not one call per chunk; tokens equal mlx-lm's."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from expertmesh.node.engine import generation

    pair = pairs("kimi_k3")
    sm = pair.me.model
    ids = sm.tokenizer.encode("experts stream from the hub layer by layer, each fetched once " * 2)
    step = 8
    assert len(ids) > 3 * step
    ref, ref_tok = oracle.load("kimi_k3")
    steps = mlx_lm.stream_generate(
        ref, ref_tok, mx.array(ids), max_tokens=1, sampler=make_sampler(0.0), prefill_step_size=step
    )
    want = [r.token for r in steps]
    monkeypatch.setattr(generation, "PREFILL_STEP", step)
    before = pair.me.store.stats.snapshot()
    got = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=1))]
    d = pair.me.store.stats.since(before)
    assert got == want
    assert d.uses["remote"] > 0 and 0 < d.remote["calls"] <= len(sm.blocks), d.remote


def test_a_prompts_call_gets_a_deadline_for_its_rows(pairs, monkeypatch) -> None:
    """A peer's service time is measured on decode's calls, a row or two per expert; a prompt's
    call carries many rows per expert and, where compute grows with rows, takes many times as
    long: its deadline allows for its rows, so the peer computes it rather than being cut off."""
    from dataclasses import replace

    from expertmesh.node.household import expert_compute

    compute = expert_compute._run

    def by_rows(block, group, rows):  # the peer's compute grows with its rows, as on a CPU
        done = compute(block, group, rows)
        time.sleep(ROW_S * sum(rows[e].shape[0] for e in group.served if e in rows))
        return done

    monkeypatch.setattr(expert_compute, "_run", by_rows)
    pair = pairs("kimi_k3")
    warm = pair.me.store.stats.snapshot()
    assert _generate(pair.me) == pair.expected  # decode's calls: their service time measured
    assert pair.me.store.stats.since(warm).remote["fallback_deadline"] == 0
    # the floor out of the way: the deadline is the measured estimate's
    monkeypatch.setattr(pair.remote, "config", replace(pair.remote.config, deadline_floor_s=0.01))
    got, alone, d = _prompt_here_and_alone(pair)
    assert got == alone
    assert d.remote["fallback_deadline"] == 0 and d.remote["calls"] > 0, d.remote


def _three_rows_a_call(pair: Pair, monkeypatch) -> tuple[int, list[node_pb2.ComputeExpertsRequest]]:
    """Calls of at most three float32 rows, so a prompt's experts are split over calls; returns
    that limit in bytes and the list every ComputeExperts request the requester sends goes into."""
    from dataclasses import replace

    from expertmesh.node.rpc.client import NodeClient

    block = pair.me.model.blocks[0]
    limit = 3 * max(block.input_width, block.output_dims) * 4
    monkeypatch.setattr(pair.remote, "config", replace(pair.remote.config, max_call_bytes=limit))
    sent: list[node_pb2.ComputeExpertsRequest] = []
    compute = NodeClient.compute_experts

    def recorded(self, request, timeout):
        sent.append(request)
        return compute(self, request, timeout)

    monkeypatch.setattr(NodeClient, "compute_experts", recorded)
    return limit, sent


def _prompt_here_and_alone(pair: Pair, peer_mode: str | None = None):
    """A prompt of several dozen tokens: its first token from the requester (with the peer, in
    `peer_mode` if given), the peer's own alone, and the requester's store counts for it."""
    ids = pair.me.model.tokenizer.encode("experts stream from the hub layer by layer, each fetched once " * 2)
    alone = [t.id for t in Generator(pair.peer.model).generate(ids, SamplingSettings(max_tokens=1))]
    if peer_mode is not None:
        pair.service.mode = peer_mode
    before = pair.me.store.stats.snapshot()
    got = [t.id for t in Generator(pair.me.model).generate(ids, SamplingSettings(max_tokens=1))]
    return got, alone, pair.me.store.stats.since(before)


def test_a_prompts_rows_are_encoded_a_few_calls_at_a_time(pairs, monkeypatch) -> None:
    """A household prompt's layer hands a peer every row routed to its experts: top-k rows a token
    as wide as the model, 0.94 GB at 4,096 tokens of K3 in float32, which the memory plan does not
    count beside the outputs. So a peer's calls are encoded as the earlier ones are answered, a few
    ahead (CALLS_ENCODED_PER_PEER), and an expert's gathered rows are let go with its last part:
    while the layer waits for an answer, at most one expert's gathered rows (one split over calls)
    is alive here, as references count, without a garbage collection. Tokens equal the peer's alone."""

    from expertmesh.node.engine.expert_rows import RoutedRows
    from expertmesh.node.household import remote_experts as rx

    pair = pairs("kimi_k3")
    _three_rows_a_call(pair, monkeypatch)  # many calls
    handed: list[weakref.ref] = []
    gather = RoutedRows.host

    def recorded(self, e):
        x = gather(self, e)
        handed.append(weakref.ref(x))
        return x

    counts = {"encoded": 0, "answered": 0}
    ahead: list[int] = []
    encode, answered = rx._Encoder.__call__, rx._PeerCalls._answered

    def counted_encode(self, batch):
        counts["encoded"] += 1
        ahead.append(counts["encoded"] - counts["answered"])
        return encode(self, batch)

    def counted_answer(self, call):
        counts["answered"] += 1
        return answered(self, call)

    alive_while_waiting: list[int] = []
    take = rx._Answers.take

    def checked(self):
        alive_while_waiting.append(sum(r() is not None for r in handed))
        return take(self)

    monkeypatch.setattr(RoutedRows, "host", recorded)
    monkeypatch.setattr(rx._Encoder, "__call__", counted_encode)
    monkeypatch.setattr(rx._PeerCalls, "_answered", counted_answer)
    monkeypatch.setattr(rx._Answers, "take", checked)
    got, alone, d = _prompt_here_and_alone(pair)
    assert got == alone
    assert d.remote["calls"] > 4 * rx.CALLS_ENCODED_PER_PEER and d.remote["fallback_error"] == 0, d.remote
    assert max(ahead) <= rx.CALLS_ENCODED_PER_PEER, ahead
    assert alive_while_waiting and max(alive_while_waiting) <= 1, alive_while_waiting


def test_a_peers_answers_are_taken_while_this_node_computes_its_own_groups(pairs, monkeypatch) -> None:
    """A layer that computes some experts here, in groups, and sends the rest to a peer takes the
    peer's answers between its groups: each is put into the outputs and let go, and the peer gets
    its next call. Encoding the next calls between groups without taking the answers held every
    answer that came meanwhile; now a peer has at most CALLS_ENCODED_PER_PEER calls held, answered
    ones waiting to be taken included, and answers are taken before the layer's own experts are
    all computed. Tokens equal the peer's alone."""
    from expertmesh.node.household import remote_experts as rx

    pair = pairs("kimi_k3")
    _three_rows_a_call(pair, monkeypatch)  # many calls
    plan = rx.RemoteExperts.plan

    def half_here(self, layer, experts, sizes):  # every other expert the peer would compute, here
        placement = plan(self, layer, experts, sizes)
        for e in sorted(placement.remote)[::2]:
            del placement.remote[e]
        return placement

    counts = {"encoded": 0, "taken": 0, "taken_between": 0}
    held: list[int] = []
    encode, take, compute_here = rx._Encoder.__call__, rx.RemoteExperts._take, rx.RemoteExperts._compute_here
    computing: list[bool] = []

    def counted_encode(self, batch):
        counts["encoded"] += 1
        held.append(counts["encoded"] - counts["taken"])
        return encode(self, batch)

    def counted_take(self, *args, **kwargs):
        counts["taken"] += 1
        counts["taken_between"] += bool(computing)
        return take(self, *args, **kwargs)

    def watched_compute_here(self, *args, **kwargs):
        computing.append(True)
        try:
            return compute_here(self, *args, **kwargs)
        finally:
            computing.pop()

    monkeypatch.setattr(rx.RemoteExperts, "plan", half_here)
    monkeypatch.setattr(rx._Encoder, "__call__", counted_encode)
    monkeypatch.setattr(rx.RemoteExperts, "_take", counted_take)
    monkeypatch.setattr(rx.RemoteExperts, "_compute_here", watched_compute_here)
    got, alone, d = _prompt_here_and_alone(pair)
    assert got == alone
    # (a call the peer refuses as busy, its slots taken by this node's fetches of the experts it
    # computes here, is computed here too: no fault, counted as a fallback)
    assert d.remote["calls"] > rx.CALLS_ENCODED_PER_PEER, d.remote
    assert sum(d.uses[k] for k in ("ram", "disk", "peer", "hub")) > 0, d.uses  # groups computed here
    assert max(held) <= rx.CALLS_ENCODED_PER_PEER, held
    assert counts["taken_between"] > 0, counts


def test_rows_and_answers_cross_to_a_peer_without_waits_of_their_own(pairs, monkeypatch) -> None:
    """The requester encodes a call's rows on the host from the layer's inputs, which the layer's
    one sync evaluated: no kernel and no wait for the device per expert sent (gathered on the
    device, each cost a gather and a sync: up to K3's 16 a layer, 93 layers a token, and a
    prompt's every part), and checks each answer from its bytes (on the device, a NaN check was
    a wait a call). The peer waits once a call, for its outputs, and reads them without another
    trip through the device per expert (a bfloat16 view was one). Counted for decode and for a
    prompt split over many calls; tokens equal the single node's."""
    from expertmesh.devtools.graph_counts import GraphCounter
    from expertmesh.node.household import expert_compute
    from expertmesh.node.household import remote_experts as rx

    pair = pairs("kimi_k3")
    sent = {"calls": 0, "experts": 0, "kernels": 0, "syncs": 0}
    answered = {"groups": 0, "experts": 0, "syncs": 0}
    encode, run = rx._Encoder.__call__, expert_compute._run

    def watched_encode(self, batch):
        with GraphCounter() as graph:
            call = encode(self, batch)
        sent["calls"] += 1
        sent["experts"] += len(batch)
        sent["kernels"] += graph.kernels
        sent["syncs"] += graph.syncs
        return call

    def watched_run(block, group, rows):
        with GraphCounter() as graph:
            started, done = run(block, group, rows)
        answered["groups"] += 1
        answered["experts"] += len(done)
        answered["syncs"] += graph.syncs
        return started, done

    check = rx.RemoteExperts._check

    def watched_check(self, block, call, response):
        with GraphCounter() as graph:
            got = check(self, block, call, response)
        sent["checked"] = sent.get("checked", 0) + 1
        sent["syncs"] += graph.syncs
        return got

    monkeypatch.setattr(rx._Encoder, "__call__", watched_encode)
    monkeypatch.setattr(rx.RemoteExperts, "_check", watched_check)
    monkeypatch.setattr(expert_compute, "_run", watched_run)
    assert _generate(pair.me) == pair.expected
    decode = dict(sent)
    _three_rows_a_call(pair, monkeypatch)
    got, alone, d = _prompt_here_and_alone(pair)
    assert got == alone and d.remote["fallback_error"] == d.remote["fallback_bad_output"] == 0, d.remote
    assert decode["experts"] > 0 and sent["calls"] > decode["calls"] and sent["checked"] > 0, (decode, sent)
    assert sent["kernels"] == sent["syncs"] == 0, (decode, sent)
    assert answered["experts"] > answered["groups"] and answered["syncs"] == answered["groups"], answered


def test_a_prompts_expert_with_more_rows_than_a_call_holds_is_split_over_calls(pairs, monkeypatch) -> None:
    """A call carries at most `max_call_bytes` of rows each way, under the message size both sides'
    gRPC accepts. An expert of a long prompt with more rows than that is not computed here for
    being large: its rows go in several calls and its answers are joined in order; tokens equal
    the peer's alone."""
    pair = pairs("kimi_k3")
    limit, sent = _three_rows_a_call(pair, monkeypatch)
    got, alone, d = _prompt_here_and_alone(pair)
    assert got == alone
    assert d.uses["remote"] > 0, d.uses
    assert d.remote["fallback_error"] == d.remote["fallback_deadline"] == d.remote["fallback_bad_output"] == 0
    assert all(len(r.rows.data) + sum(len(x.rows.data) for x in r.experts) <= limit for r in sent)
    calls_per_expert = {}
    for r in sent:
        for x in r.experts:
            calls_per_expert[(r.layer, x.expert)] = calls_per_expert.get((r.layer, x.expert), 0) + 1
    assert max(calls_per_expert.values()) > 1  # some expert's rows went in several calls


def test_an_expert_whose_later_part_comes_back_bad_is_computed_here_whole(pairs, monkeypatch) -> None:
    """A prompt's answers are written into its outputs as they come, so an expert split over two
    calls may have one part written when the other comes back bad: the expert is then computed
    here, all of its rows, over what was written. Tokens equal the peer's alone."""
    pair = pairs("kimi_k3")
    limit, sent = _three_rows_a_call(pair, monkeypatch)
    got, alone, d = _prompt_here_and_alone(pair, peer_mode="lies_after_one_call")
    assert len(sent) >= 2 and {x.expert for x in sent[0].experts} & {x.expert for x in sent[1].experts}, (
        "the first two calls share an expert: one part answered honestly, the other with NaN"
    )
    assert got == alone
    assert d.remote["calls"] >= 1 and d.remote["fallback_bad_output"] > 0, d.remote


def test_a_peers_rows_are_cut_into_calls_within_the_limit_each_expert_once_a_call() -> None:
    from types import SimpleNamespace

    from expertmesh.node.household.remote_experts import _calls

    block = SimpleNamespace(input_width=4, output_dims=4)
    counts = {1: 7, 2: 1, 5: 3}
    limit = 3 * 16  # three float32 rows
    calls = _calls(block, [1, 2, 5], counts, 4, limit)
    assert all(sum(n for _, _, n in c) * 16 <= limit for c in calls)
    assert all(len({e for e, _, _ in c}) == len(c) for c in calls)  # an expert at most once a call
    for e, n in counts.items():  # every row sent once, in order, an expert's parts in consecutive calls
        parts = [(i, first, k) for i, c in enumerate(calls) for f, first, k in c if f == e]
        assert [first for _, first, _ in parts] == list(itertools.accumulate([0] + [k for _, _, k in parts[:-1]]))
        assert sum(k for _, _, k in parts) == n
        assert [i for i, _, _ in parts] == list(range(parts[0][0], parts[0][0] + len(parts)))
    # a row larger than the limit still goes, alone
    assert [[e for e, _, _ in c] for c in _calls(block, [1], {1: 2}, 4, 8)] == [[1], [1]]


def test_a_message_past_the_limit_is_refused_by_the_sender_and_by_the_node(pairs) -> None:
    """Both ends bound a message by the same limit: a node never reads one larger (any peer may
    send anything), and a node's own channel refuses to send what no node would read."""
    from expertmesh.node import constants
    from expertmesh.node.rpc.client import NodeClient

    pair = pairs("kimi_k3")
    block = pair.me.model.blocks[0]
    n = constants.RPC_MAX_MESSAGE_BYTES // (4 * block.input_width) + 1
    rows = node_pb2.Tensor(shape=[n, block.input_width], dtype="float32", data=bytes(4 * n * block.input_width))
    request = node_pb2.ComputeExpertsRequest(
        model=node_pb2.ModelKey(repo_id=pair.me.repo_id, commit=pair.me.commit),
        layer=block.layer,
        experts=[node_pb2.ExpertRows(expert=0, rows=rows)],
    )
    with NodeClient(pair.running.address, SECRET) as client, pytest.raises(grpc.RpcError) as sent:
        client.compute_experts(request, timeout=30).result()
    assert sent.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "Sent message larger than max" in sent.value.details()  # refused here, not by the node
    with pytest.raises(grpc.RpcError) as read:
        _compute(pair, request)  # a channel with gRPC's own defaults: no limit on what it sends
    assert read.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in read.value.details()


def test_a_prompts_call_past_its_deadline_teaches_its_deadline_without_skipping_the_peer(pairs, monkeypatch) -> None:
    """A prompt's call can take longer than its deadline, a guess from decode's few rows, allows
    (every peer computes the layer at once on shared cores). Its first miss is a measurement:
    the peer took at least the deadline, the next prompt's deadlines allow for that, and the peer
    keeps computing the rest of the prompt and its decode. A second miss in a row is a fault:
    the peer is skipped, as a peer that hangs must be."""
    from dataclasses import replace

    pair = pairs("kimi_k3")
    monkeypatch.setattr(pair.remote, "config", replace(pair.remote.config, deadline_floor_s=0.05))
    assert _generate(pair.me) == pair.expected  # decode's calls: their service time measured
    link = pair.remote.links[pair.running_id]
    sm = pair.me.model
    ids = sm.tokenizer.encode("experts stream from the hub layer by layer, each fetched once " * 2)
    alone = [t.id for t in Generator(pair.peer.model).generate(ids, SamplingSettings(max_tokens=4))]

    pair.service.mode = "busy_prompt"
    before = pair.me.store.stats.snapshot()
    got = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=4))]
    d = pair.me.store.stats.since(before)
    assert got == alone
    assert d.remote["fallback_deadline"] > 0, d.remote  # the busy call missed and was computed here
    assert pair.source.table.live_count() == 1  # not skipped: the prompt's other layers and decode ran there
    assert d.uses["remote"] > 0 and d.remote["calls"] > 0, (d.uses, d.remote)
    assert link.prompt_scale > 1.0  # the next prompt's deadlines allow for what this one took

    pair.service.mode = "stuck_prompts"
    before = pair.me.store.stats.snapshot()
    got = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=1))]
    d = pair.me.store.stats.since(before)
    assert got == alone[:1]
    assert d.remote["fallback_deadline"] >= 2, d.remote
    assert pair.source.table.live_count() == 0  # missed twice in a row: skipped
