"""The features beyond plain generation — speculation, batching, peers' compute, the 8-bit core —
on architectures beyond the three tiny fixtures: one representative of each kind of cache and
expert block, made by the registry (expertmesh/devtools/tiny/registry.py) in its upstream layout.

| arch         | caches                                  | experts                                 |
|--------------|-----------------------------------------|-----------------------------------------|
| gpt_oss      | KVCache + sliding-window RotatingKVCache | biased SwitchGLU, mxfp4 blocks; sinks  |
| mimo_v2_flash| KVCache + RotatingKVCache               | FP8 with block scales                   |
| deepseek_v41 | LayerCache (window + compressed groups) | an MLX conversion                       |
| nemotron_h   | Mamba ArraysCache + KVCache             | gate-less SwitchMLP                     |
| llama4       | ChunkedKVCache + KVCache                | fused, transposed gate/up               |
| phixtral     | KVCache                                 | SwitchMLP with biases (fc1/fc2)         |
| muse_spark   | (mlx-lm runs it with Metal-only kernels: a clear error on a CPU)                  |

Prompts are longer than the tiny sliding windows and chunks (64 tokens), so windows wrap while a
request is generating. Models run in float32 (see tests/test_speculative.py): what is tested is
exactness of the algorithms, not BF16 near ties. Peers' compute is checked on the serving side
(ExpertComputer) and end to end between two nodes over real gRPC; batching falls back to one
request at a time through real gRPC and the real HTTP API. The module takes ~10 s on two CPU
cores (7-9 s measured, MLX 0.32.4).
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, RotatingKVCache
from nodes import joined, serving

from expertmesh.assembly import build_node, open_model
from expertmesh.devtools.link_emulation import LanEmulation, LanInterceptor, k3_lan
from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import registry
from expertmesh.node.config import ApiConfig, HouseholdConfig, NodeConfig, RemoteConfig, RpcConfig, StoreConfig
from expertmesh.node.engine.batching import BatchEngine, BatchingUnsupported, check_batchable
from expertmesh.node.engine.core_quantization import pull_with_core_bits
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.model_thread import model_thread
from expertmesh.node.engine.speculative import Draft, ModelDraft, SpeculationConfig
from expertmesh.node.engine.streamed_model import StreamedModel
from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.household.expert_compute import ExpertComputer
from expertmesh.node.hub import client as hub_client
from expertmesh.node.rpc import activations
from expertmesh.node.rpc.auth import call_metadata, node_method
from expertmesh.v1 import node_pb2, node_pb2_grpc
from tests.store_calls import compute_here

ARCHS = ("gpt_oss", "mimo_v2_flash", "deepseek_v41", "nemotron_h", "llama4", "phixtral", "muse_spark")
TEXT = " ".join(f"w{i} and" for i in range(60))  # far more than 64 tokens
SPEC = SpeculationConfig(mode="ngram", initial_draft=3, warmup_rounds=1000)  # never switches off
SECRET = "registry-features-secret"
IO_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def registry_hub(tmp_path_factory: pytest.TempPathFactory):
    """A local Hub serving `registry/<arch>` for ARCHS, made once per module."""
    root = tmp_path_factory.mktemp("features-hub")
    for arch in ARCHS:
        out = root / "registry" / arch
        out.mkdir(parents=True)
        registry.build(out, arch)
    with HubServer(root) as server, hub_client.using_endpoint(server.url):
        yield root / "registry"


@pytest.fixture(scope="module")
def homes(registry_hub: Path, tmp_path_factory: pytest.TempPathFactory):
    """`homes(arch, core_bits=16)`: a home with that repo pulled once per module, no expert on its
    disk (`copy=True`: a copy of it, for a test that adds experts or files)."""
    pulled: dict[tuple[str, int], Path] = {}

    def get(arch: str, core_bits: int = 16, copy: bool = False) -> Path:
        if (arch, core_bits) not in pulled:
            home = tmp_path_factory.mktemp(f"home-{arch}-{core_bits}")
            pull_with_core_bits(f"registry/{arch}", home=home, progress=False, core_bits=core_bits)
            pulled[arch, core_bits] = home
        if not copy:
            return pulled[arch, core_bits]
        dest = tmp_path_factory.mktemp(f"copy-{arch}")
        shutil.copytree(pulled[arch, core_bits], dest, dirs_exist_ok=True)
        return dest

    return get


def _float32(model) -> None:
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())


@pytest.fixture(scope="module")
def models(homes):
    """arch -> StreamedModel in float32, opened once per module."""
    opened: dict[str, StreamedModel] = {}

    def get(arch: str) -> StreamedModel:
        if arch not in opened:
            home = homes(arch, copy=True)  # the pulled home stays without experts on its disk
            sm = open_model(
                f"registry/{arch}", home=home, store=StoreConfig(ram_budget="50%", prefetch=False, fill=False)
            )
            model_thread().call(_float32, sm.model)
            opened[arch] = sm
        return opened[arch]

    yield get
    for sm in opened.values():
        sm.close()


def _ids(sm: StreamedModel, n: int, start: int = 0) -> list[int]:
    ids = sm.tokenizer.encode(TEXT)[start : start + n]
    assert len(ids) == n
    return ids


def _alone(
    sm: StreamedModel, ids: list[int], max_tokens: int, layer_major: bool = True
) -> tuple[list[int], GenerationSummary]:
    summary = GenerationSummary()
    generator = Generator(sm)
    generator.layer_major_prefill = layer_major
    out = [t.id for t in generator.generate(ids, SamplingSettings(max_tokens=max_tokens), summary=summary)]
    return out, summary


# -- speculation ------------------------------------------------------------------------------


class _Scripted:
    """Drafts the true continuation with a mistake after 0, 1, 2 ... correct tokens (cycling)."""

    def __init__(self, prompt_len: int, truth: list[int], vocab: int):
        self.prompt_len, self.truth, self.vocab, self.calls = prompt_len, truth, vocab, 0

    def propose(self, context: list[int], k: int, temp: float = 0.0, top_p: float = 1.0) -> Draft:
        done = len(context) - self.prompt_len
        true = self.truth[done : done + k]
        good = self.calls % (k + 1)
        self.calls += 1
        return Draft(true[:good] + [(t + 1) % self.vocab for t in true[good:]])


def _next_logits(gen: Generator, token: int) -> mx.array:
    logits = gen._forward([token]).logits[0, -1]
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v41", "nemotron_h", "llama4"])
def test_speculation_keeps_the_greedy_output_and_the_cache_on_every_kind_of_cache(arch: str, models) -> None:
    """Rejected drafts roll back exactly whatever the cache: a sliding window that has wrapped
    (it can no longer trim), deepseek_v41's compressed LayerCache, a Mamba state, chunked
    attention past its chunk. Before, a wrapped window ended the generation with an error in
    the middle of it, and a LayerCache model could not speculate at all."""
    sm = models(arch)
    ids = _ids(sm, 60)
    plain_gen = Generator(sm)
    plain = [t.id for t in plain_gen.generate(ids, SamplingSettings(max_tokens=16))]
    gen = Generator(sm, SPEC, draft_source=_Scripted(len(ids), plain, len(sm.tokenizer.get_vocab())))
    summary = GenerationSummary()
    got = [t.id for t in gen.generate(ids, SamplingSettings(max_tokens=16), summary=summary)]
    assert got == plain, f"{arch}: speculation changed the greedy output"
    s = summary.speculation
    assert s.drafted > s.accepted > 0 and s.passes < len(plain) - 1
    if arch in ("gpt_oss", "mimo_v2_flash"):
        windows = [c for c in gen.cache if isinstance(c, RotatingKVCache)]
        assert windows and all(c.offset > c.max_size for c in windows), "the window never wrapped: nothing tested"
    assert gen.history == plain_gen.history
    a, b = (model_thread().call(_next_logits, g, plain[-1]) for g in (gen, plain_gen))
    assert mx.abs(a - b).max().item() < 1e-4, f"{arch}: the cache after speculation differs from the plain path's"


def _draft_model(path: Path) -> ModelDraft:
    model, tokenizer = mlx_lm.load(str(path))
    model.set_dtype(mx.float32)
    return ModelDraft(model, len(tokenizer.get_vocab()))


def test_a_draft_model_with_a_sliding_window_drafts_from_the_context_after_a_rejection(registry_hub, models) -> None:
    """A draft model's cache follows the context; once its window has wrapped it cannot trim
    back to the common prefix (mlx-lm's trim then does nothing), so it starts again. Before, it
    went on from a cache holding the rejected drafts and proposed from the wrong context."""
    sm = models("gpt_oss")
    draft = model_thread().call(_draft_model, registry_hub / "gpt_oss")
    context = _ids(sm, 70)
    model_thread().call(draft.propose, context, 3)
    assert any(isinstance(c, RotatingKVCache) and not c.is_trimmable() for c in draft.cache)
    other = [*context[:66], *(_ids(sm, 6, start=100))]  # diverges from what the cache has seen
    got = model_thread().call(draft.propose, other, 3).tokens
    assert all(c.offset == len(draft.fed) for c in draft.cache), "the cache holds more than the context"
    assert draft.fed[: len(other)] == other
    fresh = model_thread().call(_draft_model, registry_hub / "gpt_oss")
    assert got == model_thread().call(fresh.propose, other, 3).tokens


# -- batching ---------------------------------------------------------------------------------


class _Run(threading.Thread):
    def __init__(self, engine: BatchEngine, ids: list[int], max_tokens: int):
        super().__init__(daemon=True)
        self.engine, self.ids, self.max_tokens = engine, ids, max_tokens
        self.tokens: list[int] = []
        self.summary = GenerationSummary()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            settings = SamplingSettings(max_tokens=self.max_tokens)
            for t in self.engine.generate(self.ids, settings, summary=self.summary):
                self.tokens.append(t.id)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e


@pytest.mark.parametrize("arch", ["gpt_oss", "nemotron_h"])
def test_batched_rows_get_their_tokens_and_their_own_expert_uses_alone(arch: str, models) -> None:
    """Three requests of different lengths, one joining mid-generation, windows wrapping while
    batched: each row's greedy tokens are its tokens alone, and its summary counts the experts
    its own tokens routed to — as many as alone — not the whole step's union."""
    sm = models(arch)
    requests = [(_ids(sm, 60), 20), (_ids(sm, 3, start=70), 24), (_ids(sm, 40, start=80), 12)]
    # alone chunk by chunk, as a batch prefills (a prompt alone goes layer-major where experts
    # stream, and a layer's union is then counted once for all of its chunks)
    alone = [_alone(sm, ids, n, layer_major=False) for ids, n in requests]
    engine = BatchEngine(sm, max_batch=4, prefill_step=128)  # one chunk, as alone: the same passes
    try:
        runs = [_Run(engine, ids, n) for ids, n in requests]
        # the first two are queued before the batch's first turn, so they share their steps
        # whatever the machine's load: the MLX thread is held until both wait for a row
        holding, release = threading.Event(), threading.Event()

        def hold() -> None:
            holding.set()
            release.wait(IO_TIMEOUT_S)

        holder = threading.Thread(target=model_thread().call, args=(hold,))
        holder.start()
        try:
            assert holding.wait(IO_TIMEOUT_S)
            runs[0].start()
            runs[1].start()
            deadline = time.monotonic() + IO_TIMEOUT_S
            while engine.waiting() < 2 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert engine.waiting() == 2
        finally:
            release.set()
            holder.join(IO_TIMEOUT_S)
        while len(runs[0].tokens) < 4 and runs[0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        runs[2].start()  # joins while the others decode
        for r in runs:
            r.join(IO_TIMEOUT_S)
            assert not r.is_alive() and r.error is None, r.error
    finally:
        engine.close()
    assert [r.tokens for r in runs] == [tokens for tokens, _ in alone]
    assert engine.steps < sum(n for _, n in requests) - len(requests)  # they did share steps
    for r, (_, summary) in zip(runs, alone):
        assert r.summary.experts.total_uses == summary.experts.total_uses > 0


class _CacheListModel:
    """What `make_prompt_cache` asks of a model: falcon_h1 and baichuan_m1 give a CacheList per layer."""

    def __init__(self, *caches):
        self.caches = caches

    def make_cache(self) -> list:
        return [CacheList(*self.caches)]


def test_a_cache_list_batches_only_if_each_of_its_caches_does() -> None:
    check_batchable(_CacheListModel(KVCache(), ArraysCache(2)))
    with pytest.raises(BatchingUnsupported, match="ChunkedKVCache"):  # its merge would fail mid-request
        check_batchable(_CacheListModel(KVCache(), ChunkedKVCache(8)))


def _node_config(home: Path, arch: str, max_batch: int) -> NodeConfig:
    return NodeConfig(
        f"registry/{arch}",
        home=home,
        node_id=f"features-{arch}",
        store=StoreConfig(prefetch=False, fill=False),
        household=HouseholdConfig(secret=SECRET, remote=RemoteConfig()),
        rpc=RpcConfig(host="127.0.0.1", port=0),
        api=ApiConfig(host="127.0.0.1", port=0),
        max_batch=max_batch,
    )


def _complete(port: int, arch: str, prompt: str, max_tokens: int) -> tuple[int, dict]:
    body = json.dumps({"model": f"registry/{arch}", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=IO_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body.encode(), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def test_a_model_mlx_lm_cannot_batch_serves_its_calls_one_at_a_time(homes) -> None:
    """llama4's chunked attention has no batched cache in mlx-lm: a node asked to batch 6 says so
    once and serves Generate calls that come together one after another, each exact; its API
    queues what the node cannot run yet instead of answering 429 (it used to send the node as
    many calls as --max-batch, and the node refused those beyond its one running and 3 waiting)."""
    arch = "llama4"
    home = homes(arch, copy=True)
    with build_node(_node_config(home, arch, max_batch=6)).start() as node:
        with pytest.raises(BatchingUnsupported):
            BatchEngine(node.model)
        assert node.service.batch is None and node.service.generation_slots.running == 1
        prompts = [("hello experts", 6), ("w1 and w2 and w3", 5), ("a", 4)]
        want = [_alone(node.model, node.model.tokenizer.encode(p), n)[0] for p, n in prompts]
        with grpc.insecure_channel(node.rpc.address) as channel:
            stub = node_pb2_grpc.NodeStub(channel)

            def call(prompt: str, n: int) -> list[int]:
                request = node_pb2.GenerateRequest(
                    model=node_pb2.ModelKey(repo_id=f"registry/{arch}"), prompt=prompt, max_tokens=n
                )
                events = stub.Generate(
                    request, metadata=call_metadata(SECRET, node_method("Generate")), timeout=IO_TIMEOUT_S
                )
                return [e.token.id for e in events if e.HasField("token")]

            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(lambda p: call(*p), prompts))
        assert got == want
        asks = [f"w{i} and" for i in range(8)]  # more than one running and three waiting
        with ThreadPoolExecutor(len(asks)) as pool:
            answers = list(pool.map(lambda p: _complete(node.api.port, arch, p, 2), asks))
    assert [status for status, _ in answers] == [200] * len(asks), [a for s, a in answers if s != 200][:1]


# -- peers' compute ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["phixtral", "nemotron_h", "gpt_oss", "mimo_v2_flash"])
def test_a_peer_computes_an_expert_as_the_requester_would(arch: str, models) -> None:
    """ComputeExperts' serving side on gate-less SwitchMLP experts (with and without biases),
    biased mxfp4 and FP8 experts: equal to the local computation, answered in the dtype of the
    rows asked with (the requester refuses any other). Before, a node running BF16 experts in
    float32 (a CPU) answered BF16 rows in float32."""
    sm = models(arch)
    _alone(sm, _ids(sm, 8), 2)  # the first layer's routed experts are now in RAM
    block = sm.blocks[0]
    held = sorted(e for (layer, e) in sm.index.experts if layer == block.layer and (layer, e) in sm.store.ram)[:3]
    assert held
    rng = np.random.default_rng(0)
    computer = ExpertComputer(sm)
    for dtype in (mx.float32, mx.bfloat16):
        rows = {
            e: mx.array(rng.standard_normal((n, block.input_width)).astype(np.float32)).astype(dtype)
            for n, e in enumerate(held, 1)
        }
        request = node_pb2.ComputeExpertsRequest(
            model=node_pb2.ModelKey(repo_id=sm.repo_id, commit=sm.commit),
            layer=block.layer,
            experts=[node_pb2.ExpertRows(expert=e, rows=activations.encode(r)) for e, r in rows.items()],
        )
        result = computer.compute(request)
        assert [x.expert for x in result.outputs] == held and not result.missing

        out = compute_here(block, sm.store, held, rows)
        want = {e: np.array(y.astype(dtype).astype(mx.float32)) for e, y in out.items()}
        wire = activations.wire_dtype(dtype)
        for x in result.outputs:
            got = activations.decode(x.rows, block.output_dims, dtype=wire, rows=rows[x.expert].shape[0])
            np.testing.assert_allclose(np.array(got.astype(mx.float32)), want[x.expert], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["phixtral", "gpt_oss"])
def test_a_node_holding_nothing_generates_with_a_compute_peer_as_alone(arch: str, homes) -> None:
    """Real gRPC between two nodes on loopback, the link shaped to K3's proportions so the cost
    model sends experts' rows to the peer that holds them: gate-less biased SwitchMLP experts
    (phixtral) and biased mxfp4 ones (gpt_oss) computed there give the single node's tokens."""
    repo = f"registry/{arch}"
    lan = LanInterceptor(LanEmulation(bandwidth=0.0, rtt_s=0.0))
    peer = serving(repo, homes(arch, copy=True), SECRET, node_id=f"peer-{arch}", interceptors=[lan])
    try:
        ids = peer.model.tokenizer.encode("hello experts, move activations")
        expected = [t.id for t in Generator(peer.model).generate(ids, SamplingSettings(max_tokens=6))]
        loc = next(iter(peer.index.experts.values()))
        lan.lan = k3_lan(loc.nbytes, peer.model.blocks[0].input_width * 4, 0.05)
        me = joined(
            repo,
            homes(arch, copy=True),
            SECRET,
            [peer.rpc.address],
            node_id=f"me-{arch}",
            store=StoreConfig(prefetch=False, disk_budget="0", ram_budget="0"),
            remote=RemoteConfig(deadline_floor_s=0.5),
        )
        try:
            before = me.store.stats.snapshot()
            got = [t.id for t in Generator(me.model).generate(ids, SamplingSettings(max_tokens=6))]
            d = me.store.stats.since(before)
        finally:
            me.close()
    finally:
        peer.close()
    assert got == expected
    assert d.uses["remote"] > 0 and d.remote["fallback_bad_output"] == d.remote["fallback_error"] == 0


# -- the 8-bit core ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v41", "nemotron_h", "llama4"])
def test_an_8_bit_core_pulls_and_generates(arch: str, homes) -> None:
    home = homes(arch, core_bits=8, copy=True)
    sm = open_model(f"registry/{arch}", home=home, store=StoreConfig(ram_budget="50%", prefetch=False, fill=False))
    try:
        assert sm.core_bits == 8
        tokens, summary = _alone(sm, sm.tokenizer.encode("hello experts"), 4)
    finally:
        sm.close()
    assert len(tokens) == 4 and summary.experts.uses["hub"] > 0


def test_a_model_mlx_lm_runs_only_on_metal_is_a_clear_error_here(homes) -> None:
    """muse_spark pulls (8-bit core too), but mlx-lm computes its attention with a Metal kernel of
    its own: on a machine without Metal generating it is one clear error, alone or in a batch —
    before, MLX's bare RuntimeError reached the user as a traceback."""
    if mx.metal.is_available():
        pytest.skip("this machine has Metal: muse_spark runs")
    home = homes("muse_spark", core_bits=8, copy=True)
    sm = open_model("registry/muse_spark", home=home, store=StoreConfig(prefetch=False, fill=False))
    try:
        ids = sm.tokenizer.encode("hello experts")
        with pytest.raises(UnsupportedModelError, match="Metal"):
            _alone(sm, ids, 2)
        engine = BatchEngine(sm, max_batch=2)
        try:
            with pytest.raises(UnsupportedModelError, match="Metal"):
                list(engine.generate(ids, SamplingSettings(max_tokens=2)))
        finally:
            engine.close()
    finally:
        sm.close()
