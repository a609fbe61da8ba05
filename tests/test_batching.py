"""Continuous batching (node/engine/batching.py): several requests share each forward pass and each
one's greedy tokens are exactly its tokens alone (float32 tiny models), whether it starts with the
others, joins mid-generation, or runs beside one that is cancelled; max_tokens, seeds and stop
sequences stay per request; through the real gRPC service and the real HTTP API; the batch-size
and request-latency metrics move."""

from __future__ import annotations

import http.client
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from repos import KIMI_K3, tiny_id
from waiting import wait_until

from expertmesh.assembly import build_node, open_model
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_api import Coordinator, CoordinatorConfig, OpenAIServer
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import (
    HouseholdConfig,
    MetricsConfig,
    NodeConfig,
    RemoteConfig,
    RpcConfig,
    SpeculationConfig,
    StoreConfig,
)
from expertmesh.node.engine.batching import BatchEngine
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.sampling import make_row_sampler
from expertmesh.node.engine.streamed_model import StreamedModel
from expertmesh.node.rpc.auth import call_metadata, node_method
from expertmesh.v1 import node_pb2, node_pb2_grpc

ARCHS = ["kimi_k3", "deepseek_v3", "qwen3_moe"]  # KDA state + MLA; MLA; plain attention, BF16 experts
PROMPTS = ("hello experts", "The quick brown fox jumps over", "for layer in range", "a")
SECRET = "batching-test-secret"
IO_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def models(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory):
    """arch -> (StreamedModel, BatchEngine of 4), opened once per module."""
    opened: dict[str, tuple[StreamedModel, BatchEngine]] = {}

    def get(arch: str) -> tuple[StreamedModel, BatchEngine]:
        if arch not in opened:
            home = tmp_path_factory.mktemp(f"batch-{arch}")
            pulled_home(arch, home)
            sm = open_model(tiny_id(arch), home=home, store=StoreConfig(prefetch=False, fill=False))
            opened[arch] = (sm, BatchEngine(sm, max_batch=4, prefill_step=8))
        return opened[arch]

    yield get
    for sm, engine in opened.values():
        engine.close()
        sm.close()


def _alone(sm: StreamedModel, ids: list[int], settings: SamplingSettings) -> list[int]:
    return [t.id for t in Generator(sm).generate(ids, settings)]


class _Run(threading.Thread):
    """One request in the engine on a thread of its own: its tokens and summary as they come."""

    def __init__(self, engine: BatchEngine, ids: list[int], settings: SamplingSettings, stop_after: int | None = None):
        super().__init__(daemon=True)
        self.engine, self.ids, self.settings, self.stop_after = engine, ids, settings, stop_after
        self.tokens: list[int] = []
        self.summary = GenerationSummary()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            it = self.engine.generate(self.ids, self.settings, summary=self.summary)
            for t in it:
                self.tokens.append(t.id)
                if self.stop_after is not None and len(self.tokens) >= self.stop_after:
                    it.close()  # the caller leaves mid-generation
                    break
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e


def _finish(runs: list[_Run]) -> None:
    for r in runs:
        r.join(IO_TIMEOUT_S)
        assert not r.is_alive(), "a batched generation did not end"
        assert r.error is None, r.error


@pytest.mark.parametrize("arch", ARCHS)
def test_four_at_once_give_each_its_tokens_alone_with_its_own_max_tokens(arch: str, models, oracle) -> None:
    sm, engine = models(arch)
    ids = [sm.tokenizer.encode(p) for p in PROMPTS]
    settings = [SamplingSettings(max_tokens=n) for n in (20, 16, 11, 7)]
    alone = [_alone(sm, i, s) for i, s in zip(ids, settings)]
    assert alone[0] == oracle.tokens(arch, ids[0], 20)  # and alone is mlx-lm
    steps = engine.steps
    runs = [_Run(engine, i, s) for i, s in zip(ids, settings)]
    for r in runs:
        r.start()
    _finish(runs)
    assert [r.tokens for r in runs] == alone
    assert all(r.summary.stop_reason in ("length", "eos") for r in runs)
    assert [r.summary.generated_tokens for r in runs] == [len(a) for a in alone]
    # shared steps: fewer forward passes than the requests' tokens one by one
    assert engine.steps - steps < sum(len(a) for a in alone) - len(runs)


def test_a_request_joining_mid_generation_and_the_running_one_keep_their_tokens(models) -> None:
    sm, engine = models("kimi_k3")
    long_ids, late_ids = sm.tokenizer.encode("The household shares"), sm.tokenizer.encode("a late question here")
    long_s, late_s = SamplingSettings(max_tokens=40), SamplingSettings(max_tokens=12)
    alone_long, alone_late = _alone(sm, long_ids, long_s), _alone(sm, late_ids, late_s)
    assert len(alone_long) > 20, "the long request must still run when the late one joins"
    first = _Run(engine, long_ids, long_s)
    first.start()
    assert wait_until(lambda: len(first.tokens) >= 5, timeout_s=IO_TIMEOUT_S)
    late = _Run(engine, late_ids, late_s)
    late.start()
    assert wait_until(lambda: late.tokens or late.error, timeout_s=IO_TIMEOUT_S)
    assert len(first.tokens) < len(alone_long)  # the late one's first token came while the first ran
    _finish([first, late])
    assert first.tokens == alone_long and late.tokens == alone_late


def test_a_cancelled_request_leaves_the_others_undisturbed(models) -> None:
    sm, engine = models("deepseek_v3")
    ids = [sm.tokenizer.encode(p) for p in PROMPTS[:3]]
    settings = SamplingSettings(max_tokens=18)
    alone = [_alone(sm, i, settings) for i in ids]
    runs = [
        _Run(engine, ids[0], settings),
        _Run(engine, ids[1], settings, stop_after=3),
        _Run(engine, ids[2], settings),
    ]
    for r in runs:
        r.start()
    _finish(runs)
    assert runs[0].tokens == alone[0] and runs[2].tokens == alone[2]
    assert runs[1].tokens == alone[1][:3]
    assert wait_until(lambda: runs[1].summary.stop_reason == "interrupted", timeout_s=10)
    assert wait_until(lambda: engine.active() == 0, timeout_s=10)


def test_a_failed_step_ends_its_rows_with_the_error_and_the_next_request_is_exact(models) -> None:
    """An expert that cannot be had mid-step fails every row of that step (the gRPC service maps it
    to UNAVAILABLE) and drops the batch cache; nothing of it leaks into the next request."""
    from expertmesh.node.errors import DownloadError

    sm, engine = models("kimi_k3")
    ids = [sm.tokenizer.encode(p) for p in PROMPTS[:2]]
    settings = SamplingSettings(max_tokens=30)
    runs = [_Run(engine, i, settings) for i in ids]
    for r in runs:
        r.start()
    assert wait_until(lambda: all(len(r.tokens) >= 2 for r in runs), timeout_s=IO_TIMEOUT_S)

    def unavailable(*args, **kwargs):
        raise DownloadError("the Hub is gone (test)")

    sm.store.layer_groups = unavailable  # an instance attribute: the blocks call this one
    try:
        for r in runs:
            r.join(IO_TIMEOUT_S)
    finally:
        del sm.store.layer_groups
    assert all(isinstance(r.error, DownloadError) for r in runs)
    assert all(len(r.tokens) < 30 for r in runs)
    assert wait_until(lambda: engine.active() == 0, timeout_s=10)
    after = _Run(engine, ids[0], SamplingSettings(max_tokens=12))
    after.start()
    _finish([after])
    assert after.tokens == _alone(sm, ids[0], SamplingSettings(max_tokens=12))


def test_seeded_sampling_in_a_batch_draws_what_it_draws_alone(models) -> None:
    sm, engine = models("kimi_k3")
    ids = [sm.tokenizer.encode(p) for p in PROMPTS]
    seeded = [SamplingSettings(max_tokens=10, temp=1.0, top_p=0.9, seed=s) for s in (7, 8, 9, 10)]
    alone = [_alone(sm, i, s) for i, s in zip(ids, seeded)]
    runs = [_Run(engine, i, s) for i, s in zip(ids, seeded)]
    for r in runs:
        r.start()
    _finish(runs)
    assert [r.tokens for r in runs] == alone
    assert len({tuple(a) for a in alone}) > 1


def test_penalties_and_logprobs_in_a_batch_are_what_they_are_alone(models) -> None:
    """Each row runs its own logits processors on its own tokens (engine/sampling.py's Decoder),
    and hands out the same log probabilities as the request alone."""
    sm, engine = models("kimi_k3")
    ids = [sm.tokenizer.encode(p) for p in PROMPTS]
    settings = [
        SamplingSettings(max_tokens=8, presence_penalty=2.0, logprobs=True, top_logprobs=3),
        SamplingSettings(max_tokens=8, repetition_penalty=3.0, top_k=2, temp=0.5, seed=3),
        SamplingSettings(max_tokens=8, logit_bias={5: 100.0}),
        SamplingSettings(max_tokens=8, frequency_penalty=-2.0, min_p=0.5, temp=1.0, seed=4),
    ]
    alone = [_alone(sm, i, s) for i, s in zip(ids, settings)]
    runs = [_Run(engine, i, s) for i, s in zip(ids, settings)]
    for r in runs:
        r.start()
    _finish(runs)
    assert [r.tokens for r in runs] == alone
    assert alone[2] == [5] * 8  # the bias is honoured
    chosen = [t.chosen for t in Generator(sm).generate(ids[0], settings[0])]
    assert all(c is not None and len(c.top) == 3 and c.top[0].logprob == c.logprob for c in chosen)


def test_a_keyed_sampler_splits_its_key_as_mlx_seeds_the_global_one() -> None:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    logprobs = mx.log(mx.softmax(mx.random.normal((1, 64), key=mx.random.key(1)), axis=-1))
    settings = SamplingSettings(temp=0.7, top_p=0.8, seed=123)
    mx.random.seed(123)
    plain = make_sampler(0.7, 0.8)
    expected = [plain(logprobs).item() for _ in range(12)]
    keyed = make_row_sampler(settings, 64, keyed=True)
    assert [keyed(logprobs).item() for _ in range(12)] == expected
    assert len(set(expected)) > 1  # it really samples


# -- the node: gRPC Generate and the HTTP API --------------------------------------------------


def _batching_node(home, node_id: str, **fields) -> NodeConfig:
    """A full node of the tiny kimi_k3 serving Generate in batches of 4."""
    return NodeConfig(
        KIMI_K3,
        home=home,
        node_id=node_id,
        store=StoreConfig(prefetch=False),
        household=HouseholdConfig(secret=SECRET, remote=RemoteConfig()),
        rpc=RpcConfig(host="127.0.0.1", port=0),
        max_batch=4,
        **fields,
    )


@pytest.fixture(scope="module")
def node(module_home):
    with build_node(_batching_node(module_home, "batcher", metrics=MetricsConfig("127.0.0.1", 0))).start() as served:
        yield served


def _generate(stub, prompt: str, max_tokens: int, **fields):
    request = node_pb2.GenerateRequest(
        model=node_pb2.ModelKey(repo_id=KIMI_K3), prompt=prompt, max_tokens=max_tokens, **fields
    )
    return stub.Generate(request, metadata=call_metadata(SECRET, node_method("Generate")), timeout=IO_TIMEOUT_S)


def _metric(node, name: str) -> float:
    return node.metrics.registry.get_sample_value(name) or 0.0


def test_generate_calls_at_once_share_steps_and_each_gets_mlx_lm_tokens(node, oracle) -> None:
    assert node.service.generation_slots.running == 4
    steps, sizes = _metric(node, "expertmesh_batch_size_count"), _metric(node, "expertmesh_batch_size_sum")
    requests = _metric(node, "expertmesh_request_seconds_count")
    prompts = [("The household shares", 20), ("hello experts", 14), ("for layer in range", 9), ("a", 5)]
    with grpc.insecure_channel(node.rpc.address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        with ThreadPoolExecutor(len(prompts)) as pool:
            streams = list(pool.map(lambda p: list(_generate(stub, *p)), prompts))
    for (prompt, n), events in zip(prompts, streams):
        assert [e.token.id for e in events if e.HasField("token")] == oracle.tokens("kimi_k3", prompt, n)
        assert events[-1].done.generated_tokens == len(events) - 1
        # each token's expert uses are its own rows', not its batch's: they add up to the request's
        per_token = sum(e.token.expert_uses for e in events if e.HasField("token"))
        assert per_token == sum(events[-1].done.expert_uses.values()) > 0
    steps_now, sizes_now = _metric(node, "expertmesh_batch_size_count"), _metric(node, "expertmesh_batch_size_sum")
    assert steps_now > steps and (sizes_now - sizes) / (steps_now - steps) > 1.0  # rows shared steps
    assert _metric(node, "expertmesh_request_seconds_count") == requests + len(prompts)
    body = _get(node.metrics_server.url)
    assert "expertmesh_batch_size_bucket" in body and "expertmesh_request_seconds_bucket" in body


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=IO_TIMEOUT_S) as r:
        return r.read().decode()


def test_a_generate_joining_and_one_cancelled_mid_batch_leave_the_others_exact(node, oracle) -> None:
    with grpc.insecure_channel(node.rpc.address) as channel:
        stub = node_pb2_grpc.NodeStub(channel)
        long_call = _generate(stub, "The household", 60)
        doomed = _generate(stub, "hello experts", 200)
        long_tokens = []
        for event in long_call:  # the long one runs; the doomed one beside it
            long_tokens.append(event.token.id)
            if len(long_tokens) == 5:
                break
        doomed_tokens = [next(doomed).token.id for _ in range(3)]
        doomed.cancel()
        joined = list(_generate(stub, "for layer in range", 10))  # joins while the long one runs
        long_tokens += [e.token.id for e in long_call if e.HasField("token")]
    assert long_tokens == oracle.tokens("kimi_k3", "The household", 60)
    assert [e.token.id for e in joined if e.HasField("token")] == oracle.tokens("kimi_k3", "for layer in range", 10)
    assert doomed_tokens == oracle.tokens("kimi_k3", "hello experts", 200)[:3]
    assert wait_until(lambda: node.service.generation_slots.in_use() == 0, timeout_s=10)
    assert wait_until(lambda: node.service.batch.active() == 0, timeout_s=10)


def _complete(port: int, **fields) -> dict:
    body = json.dumps({"model": KIMI_K3, "temperature": 0, **fields}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=IO_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        return json.loads(response.read())
    finally:
        conn.close()


def test_the_api_batches_requests_with_their_own_stop_and_max_tokens(node) -> None:
    config = CoordinatorConfig(secret=SECRET, models=lambda: [KIMI_K3], generations_per_node=4)
    api = OpenAIServer(Coordinator(config, NodePool([node.rpc.address])), "127.0.0.1", 0).start()
    try:
        asks = [
            {"prompt": "The household shares", "max_tokens": 24},
            {"prompt": "hello experts", "max_tokens": 9},
            {"prompt": "for layer in range", "max_tokens": 16},
            {"prompt": "a", "max_tokens": 12},
        ]
        alone = [_complete(api.port, **a)["choices"][0] for a in asks]
        # a stop sequence from the middle of one answer's text: that request stops there, only it
        text = alone[0]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop.strip(), "the tiny model's answer has no text to stop at"
        asks[0]["stop"] = [stop]
        steps = _metric(node, "expertmesh_batch_size_count")
        sizes = _metric(node, "expertmesh_batch_size_sum")
        with ThreadPoolExecutor(len(asks)) as pool:
            together = list(pool.map(lambda a: _complete(api.port, **a)["choices"][0], asks))
        assert together[0]["text"] == text[: text.index(stop)] and together[0]["finish_reason"] == "stop"
        assert [c["text"] for c in together[1:]] == [c["text"] for c in alone[1:]]
        assert [c["finish_reason"] for c in together[1:]] == [c["finish_reason"] for c in alone[1:]]
        steps_now, sizes_now = _metric(node, "expertmesh_batch_size_count"), _metric(node, "expertmesh_batch_size_sum")
        assert (sizes_now - sizes) / (steps_now - steps) > 1.0
    finally:
        api.stop()


def test_serve_batches_four_by_default_and_refuses_a_batch_of_none() -> None:
    import argparse

    from expertmesh.cli import arguments, build_parser, serve

    def serving_config(*argv: str) -> NodeConfig:
        return serve.node_config(build_parser().parse_args(["serve", KIMI_K3, "--speculate", "off", *argv]), SECRET)

    assert serving_config().max_batch == 4 and serving_config("--max-batch", "3").max_batch == 3

    def parsed(*argv: str) -> int:
        p = argparse.ArgumentParser()
        arguments.add_speculation_arguments(p)
        arguments.add_batch_arguments(p)
        return arguments.max_batch(p.parse_args(list(argv)))

    from expertmesh.node.config import DEFAULT_MAX_BATCH

    assert parsed() == DEFAULT_MAX_BATCH > 1
    assert parsed("--max-batch", "1", "--speculate", "ngram") == 1
    assert parsed("--max-batch", "2") == 2
    with pytest.raises(SystemExit):
        parsed("--max-batch", "0")


def test_a_call_alone_speculates_and_calls_together_batch(
    pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory, oracle
) -> None:
    # drafts cannot be verified inside a batch; alone (one person asking) a call keeps speculation
    home = tmp_path_factory.mktemp("batch-speculating")
    pulled_home("kimi_k3", home)
    config = _batching_node(home, "speculating-batcher", speculation=SpeculationConfig(mode="ngram"))
    prompts = [("The household shares", 24), ("hello experts", 14), ("for layer in range", 9)]
    with build_node(config).start() as served, grpc.insecure_channel(served.rpc.address) as channel:
        assert served.service.batch is not None and served.service.speculation is not None
        stub = node_pb2_grpc.NodeStub(channel)
        alone = list(_generate(stub, *prompts[0]))
        assert [e.token.id for e in alone if e.HasField("token")] == oracle.tokens("kimi_k3", *prompts[0])
        assert alone[-1].done.forward_passes > 0  # it ran the speculative loop (verify passes counted)
        with ThreadPoolExecutor(len(prompts)) as pool:
            streams = list(pool.map(lambda p: list(_generate(stub, *p)), prompts))
        for (prompt, n), events in zip(prompts, streams):
            assert [e.token.id for e in events if e.HasField("token")] == oracle.tokens("kimi_k3", prompt, n)
        speculated = [events[-1].done.forward_passes > 0 for events in streams]
        assert speculated.count(True) <= 1 and speculated.count(False) >= 2  # the others shared a batch


def test_max_batch_one_runs_one_call_at_a_time_with_speculation(node) -> None:
    from expertmesh.node.service import NodeService

    alone = NodeService(node.model, "a", node.experts, speculation=SpeculationConfig(mode="ngram"), max_batch=1)
    assert alone.batch is None and alone.speculation is not None and alone.generation_slots.running == 1
