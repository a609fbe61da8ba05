"""What goes wrong around generation, and what the user then sees: a model not pulled, a Hub
failing mid-answer, a prompt longer than the context, debris in the disk cache, models that
cannot be streamed. Each error is an ExpertmeshError whose message says what to do or what
failed, and after each the same model still generates mlx-lm's tokens."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from repos import tiny_id

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import Fault, HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.blocks import load_core_model
from expertmesh.node.engine.generation import ContextLengthError, GenerationSummary, Generator, SamplingSettings
from expertmesh.node.engine.streamed_model import StreamedModel
from expertmesh.node.errors import DownloadError, ExpertmeshError, NotPulledError, UnsupportedModelError
from expertmesh.node.hub import client as hub_client
from expertmesh.node.store.tiers.disk import TMP_SUFFIX

ARCH = "kimi_k3"
REPO_ID = tiny_id(ARCH)
PROMPT = "hello experts"
GREEDY = SamplingSettings(max_tokens=24, temp=0.0, top_p=1.0, seed=None)
# Fast retries for the failing-Hub test; the default RangeReader (8 retries, 0.25 s base,
# 8 s cap) would spend ~15 s of backoff on each failing range.
FAST_RETRIES = dict(max_retries=2, backoff_base_s=0.01, backoff_max_s=0.05)


@pytest.fixture(scope="module")
def oracle_tokens(oracle):
    """prompt ids -> mlx-lm's greedy tokens on the whole repo (conftest's session oracle)."""
    return lambda ids, max_tokens=GREEDY.max_tokens: oracle.tokens(ARCH, ids, max_tokens)


def _open(home: Path, **kwargs) -> StreamedModel:
    return open_model(REPO_ID, home=home, store=StoreConfig(ram_budget="50%", fill=False), **kwargs)


def _generate(
    sm: StreamedModel, ids: list[int], settings: SamplingSettings = GREEDY
) -> tuple[list[int], GenerationSummary]:
    summary = GenerationSummary()
    return [t.id for t in Generator(sm).generate(ids, settings, summary=summary)], summary


def _cache_files(sm: StreamedModel) -> list[Path]:
    """The files of the disk tier's layout `{layer}/{expert}.bin` (and whatever else lies there)."""
    return sorted(p for p in sm.disk.root.glob("*/*") if p.is_file())


def test_not_pulled_says_which_command_pulls_it(tmp_path: Path) -> None:
    with pytest.raises(NotPulledError, match=re.escape(f"expertmesh pull {REPO_ID}")) as e:
        open_model(REPO_ID, home=tmp_path)
    assert isinstance(e.value, ExpertmeshError)
    with pytest.raises(NotPulledError, match=re.escape(f"expertmesh pull {REPO_ID} --revision v2")):
        open_model(REPO_ID, revision="v2", home=tmp_path)


def test_hub_failing_mid_generation_then_recovering(pulled_home, hub: HubServer, oracle_tokens, tmp_path: Path) -> None:
    pulled_home(ARCH, tmp_path)
    sm = _open(tmp_path, hub_reader=hub_client.RangeReader(**FAST_RETRIES))
    try:
        ids = sm.tokenizer.encode(PROMPT)
        expected = oracle_tokens(ids)
        got: list[int] = []
        with pytest.raises(ExpertmeshError) as e:
            for token in Generator(sm).generate(ids, GREEDY):
                got.append(token.id)
                if len(got) == 3:  # from now on every range request for an expert fails
                    hub.knobs.faults = [Fault("500", count=10_000, path_glob="*.safetensors")]
        assert isinstance(e.value, DownloadError)
        message = str(e.value)
        assert hub.url in message and "HTTP 500" in message, message  # names the source and the failure
        assert "\n" not in message  # the CLI prints it on one line
        assert 3 <= len(got) < len(expected), "the failure should land mid-generation"
        assert got == expected[: len(got)]
        assert hub.stats()["faults"].get("500", 0) >= FAST_RETRIES["max_retries"] + 1

        # Let the layer's other fetches (still retrying against the faults) finish, so the
        # recovery below cannot join a fetch that is about to fail.
        deadline = time.monotonic() + 10
        while sm.store.flights.in_flight_count() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not sm.store.flights.in_flight_count()

        # The disk cache holds whole experts only: no temporary files, every size exact.
        files = _cache_files(sm)
        assert files, "the tokens before the failure fetched experts, which the disk should keep"
        assert not [p for p in sm.disk.root.rglob("*") if p.name.endswith(TMP_SUFFIX)]
        for p in files:
            assert p.suffix == ".bin", p
            layer, expert = int(p.parent.name), int(p.stem)
            assert p.stat().st_size == sm.index.expert(layer, expert).nbytes, p
        assert len(sm.disk) == len(files)

        hub.knobs.faults = []
        tokens, summary = _generate(sm, ids)  # a fresh Generator: the failed one's cache is half-fed
        assert tokens == expected
        assert summary.experts.uses["hub"] > 0  # the experts that failed were fetched now
    finally:
        hub.knobs.faults = []
        sm.close()


def test_prompt_longer_than_the_context(
    pulled_home, hub: HubServer, oracle_tokens, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pulled_home(ARCH, tmp_path)
    sm = _open(tmp_path)
    try:
        limit = 12
        config = sm.config.get("text_config", sm.config)  # where max_context reads it
        monkeypatch.setitem(config, "max_position_embeddings", limit)
        assert sm.max_context == limit
        long_ids = sm.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2)
        assert len(long_ids) > limit + 1
        gen = Generator(sm)
        with pytest.raises(ContextLengthError) as e:
            next(gen.generate(long_ids, GREEDY))
        assert isinstance(e.value, ExpertmeshError)
        assert re.search(rf"\b{len(long_ids)}\b", str(e.value)) and re.search(rf"\b{limit}\b", str(e.value)), str(
            e.value
        )
        assert gen.history == []  # nothing was fed
        with pytest.raises(ContextLengthError):  # a prompt filling the context leaves no room to answer
            next(gen.generate(long_ids[:limit], GREEDY))

        # A short prompt generates until prompt + answer fill the context, then says so.
        ids = sm.tokenizer.encode(PROMPT)
        assert len(ids) + 2 < limit
        tokens, summary = _generate(sm, ids)
        assert summary.stop_reason == "context"
        assert len(ids) + len(tokens) == limit
        assert tokens == oracle_tokens(ids)[: len(tokens)]
    finally:
        sm.close()


def test_disk_cache_debris_is_removed_at_start(pulled_home, hub: HubServer, oracle_tokens, tmp_path: Path) -> None:
    pulled_home(ARCH, tmp_path)
    sm = _open(tmp_path)
    ids = sm.tokenizer.encode(PROMPT)
    expected = oracle_tokens(ids)
    try:
        assert _generate(sm, ids)[0] == expected
        files = _cache_files(sm)
    finally:
        sm.close()
    assert len(files) > 2

    victim = files[len(files) // 2]  # an expert this prompt uses, cut short as by a bad write
    full_size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[: full_size // 2])
    layer_dir = victim.parent
    debris = [layer_dir / f"{victim.name}.4242.1{TMP_SUFFIX}", layer_dir / "99999.bin", layer_dir / "notes.txt"]
    for p in debris:
        p.write_bytes(b"\0" * 16)

    sm = _open(tmp_path)
    try:
        for p in [victim, *debris[:2]]:
            assert not p.exists(), f"{p.name} survived the disk cache's start-up"
        assert debris[2].exists()  # not a name the cache writes: someone else's, left alone
        assert len(sm.disk) == len(files) - 1
        tokens, summary = _generate(sm, ids)
        assert tokens == expected
        assert summary.experts.uses["hub"] == 1  # only the cut expert came again from the Hub
        assert victim.stat().st_size == full_size
    finally:
        sm.close()


def test_a_stray_directory_in_the_disk_cache_does_not_stop_start_up(
    pulled_home, hub: HubServer, tmp_path: Path
) -> None:
    pulled_home(ARCH, tmp_path)
    sm = _open(tmp_path)
    root = sm.disk.root
    sm.close()
    (root / "1" / "junk").mkdir(parents=True)
    _open(tmp_path).close()


def _dense_mlx_lm_model(folder: Path) -> Path:
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    config = {
        "model_type": "llama",
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 32,
    }
    folder.mkdir(parents=True)
    save_model(folder, llama.Model(llama.ModelArgs.from_dict(config)))
    save_config(config, folder / "config.json")
    return folder


def test_models_that_cannot_stream(tmp_path: Path) -> None:
    dense = _dense_mlx_lm_model(tmp_path / "dense")
    with pytest.raises(UnsupportedModelError, match="Mixture-of-Experts"):
        load_core_model(dense)
    config = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    with pytest.raises(UnsupportedModelError, match="no_such_arch"):
        load_core_model(dense)
