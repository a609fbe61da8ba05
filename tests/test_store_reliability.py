"""Generation through a misbehaving Hub and a killed process: the output never changes, nothing
corrupt is kept, and a rerun continues where the killed one stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import Fault, HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.hub import client as hub_client
from expertmesh.node.store.integrity import DIGESTS_FILENAME, DigestBook, sha256

PROMPT = "Faults come in bursts"
FAST = dict(max_retries=8, backoff_base_s=0.005, backoff_max_s=0.05, timeout_s=0.5)


def _generate(home: Path, reader=None, tokens: int = 16):
    # one response per expert (no demand runs), so each fault below spoils exactly one expert
    sm = open_model(KIMI_K3, home=home, store=StoreConfig(prefetch=False, coalesce=False), hub_reader=reader)
    try:
        ids = sm.tokenizer.encode(PROMPT)
        out = [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=tokens))]
        return out, sm.store.stats.snapshot(), sm.disk.root, sm.tokenizer.decode(out)
    finally:
        sm.close()


def _assert_cache_is_clean(root: Path) -> None:
    book = DigestBook(root / DIGESTS_FILENAME)
    files = list(root.glob("*/*.bin"))
    assert files and not list(root.glob("*/*.tmp"))
    for path in files:
        assert sha256(path.read_bytes()) == book.get((int(path.parent.name), int(path.stem))), path


@pytest.fixture(scope="module")
def reference(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("clean")
    pulled_home("kimi_k3", home)
    tokens, _, _, text = _generate(home)
    return tokens, text


def test_every_hub_fault_is_retried_and_the_output_is_unchanged(
    pulled_home, hub: HubServer, reference, tmp_path: Path
) -> None:
    pulled_home("kimi_k3", tmp_path)
    glob = "*.safetensors"
    hub.knobs.faults = [
        # each 429 closes the resolvers' gate for the second huggingface_hub adds (node/hub/rate_limit.py):
        # a few show the retry without a rate's dozen seconds of closed gates
        Fault("429", count=3, retry_after_s=0, path_glob=glob),
        Fault("503", rate=0.04, retry_after_s=0, path_glob=glob),
        Fault("500", rate=0.04, path_glob=glob),
        Fault("cut", rate=0.08, path_glob=glob),
        Fault("stall", rate=0.03, stall_s=1.5, path_glob=glob),
        Fault("ignore_range", rate=0.04, path_glob=glob),
        Fault("wrong_range", rate=0.04, path_glob=glob),
    ]
    faults_before = hub.stats()["faults"]
    reader = hub_client.RangeReader(**FAST)
    try:
        tokens, stats, root, _ = _generate(tmp_path, reader)
    finally:
        hub.knobs.faults = []
    assert tokens == reference[0]
    faults = {k: n - faults_before.get(k, 0) for k, n in hub.stats()["faults"].items()}
    assert faults.get("429") == 3 and sum(faults.values()) >= 5 and reader.retries >= 5, faults
    assert stats.uses["hub"] > 0
    _assert_cache_is_clean(root)


def test_wrong_bytes_on_a_refetch_are_caught_and_fetched_again(
    pulled_home, hub: HubServer, reference, tmp_path: Path
) -> None:
    pulled_home("kimi_k3", tmp_path)
    _, first, root, _ = _generate(tmp_path)
    for path in root.glob("*/*.bin"):  # the digests stay, the copies go: every expert comes again
        path.unlink()
    hub.knobs.faults = [Fault("wrong_bytes", count=2, path_glob="*.safetensors")]  # within the store's refetches
    try:
        tokens, stats, root, _ = _generate(tmp_path, hub_client.RangeReader(**FAST))
    finally:
        hub.knobs.faults = []
    assert tokens == reference[0]
    assert stats.integrity_failures["hub"] == 2  # each flipped copy caught by its recorded sha256
    _assert_cache_is_clean(root)


@pytest.mark.e2e
def test_a_run_killed_while_fetching_restarts_cleanly(pulled_home, hub: HubServer, reference, tmp_path: Path) -> None:
    pulled_home("kimi_k3", tmp_path)
    env = {**os.environ, "EXPERTMESH_HOME": str(tmp_path), "HF_ENDPOINT": hub.url}
    cmd = [sys.executable, "-m", "expertmesh", "run", KIMI_K3, PROMPT, "--max-tokens", "16", "--no-prefetch"]
    hub.knobs.ttfb_s = 0.03  # slow enough that the kill lands among fetches
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        root = tmp_path / "experts"
        deadline = time.monotonic() + 120
        while len(list(root.glob("*/*/*/*.bin"))) < 10 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert proc.poll() is None, "the run ended before it could be killed: make the Hub slower"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        hub.knobs.ttfb_s = 0.0
        proc.stdout.close()
        proc.stderr.close()
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stdout == reference[1] + "\n"
    assert "hub" in rerun.stderr and "disk" in rerun.stderr  # it continued from what the killed run kept
    _assert_cache_is_clean(next(root.glob("*/*")))
