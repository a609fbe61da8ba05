"""Shared fixtures, built once per test session: the tiny repos (deterministic), a pulled home of
each (copied for a test that wants its own), and the mlx-lm oracle every streamed generation is
compared with."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import loopback
import mlx.core as mx
import mlx_lm
import pytest
from repos import tiny_id

from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import ARCHS, make_tiny_model
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub.pull import pull

pytest_plugins = ["process_guard", "suite_pace"]  # the e2e marker kept true; workers and compiled modules

DENSE_EXPERT_ARCHS = ("qwen3_moe",)  # BF16 experts: streamed in float32 on a CPU (see Oracle.load)


@pytest.fixture(scope="session")
def tiny_repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> a folder `hub/expertmesh/tiny-<arch>` holding that tiny repo (seed 0)."""
    hub = tmp_path_factory.mktemp("hub")
    return {arch: make_tiny_model(hub / tiny_id(arch), arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def hub_root(tiny_repos: dict[str, Path]) -> Path:
    """The folder of repos that `expertmesh hub` serves in tests."""
    return next(iter(tiny_repos.values())).parent.parent


@pytest.fixture(scope="session")
def tool_repos(tiny_repos: dict[str, Path], hub_root: Path) -> dict[str, Path]:
    """family -> the tiny repo that speaks that tool-call format (expertmesh/devtools/tiny/tool_formats.py),
    written beside the tiny repos so the Hub serves it and `pulled_home(family, ...)` pulls it.
    Made only for the tests that ask: linked weights and a tokenizer each, a second or so."""
    from expertmesh.devtools.tiny.tool_formats import FORMATS, make_tool_repo

    return {f: make_tool_repo(hub_root / tiny_id(f), f, tiny_repos[fmt.base]) for f, fmt in FORMATS.items()}


@pytest.fixture(scope="module")
def hub(hub_root: Path):
    """A local Hub serving the tiny repos on loopback, with huggingface_hub pointed at it; one per
    test module, so a module's faults and link settings never leak into another's."""
    with HubServer(hub_root) as server, hub_client.using_endpoint(server.url):
        yield server
        server.knobs.faults = []


@pytest.fixture(scope="session")
def pulled_home(hub_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`pulled_home(arch, dest, index_only=False)`: a home at `dest` with that tiny repo pulled (core
    and index, or the index only, as a cache peer pulls; no expert), copied from one pulled once per
    session. Its commit is the Hub's hash of the repo's bytes, so any test Hub serves its experts."""
    pulled: dict[tuple[str, bool], Path] = {}

    def make(arch: str, dest: Path, index_only: bool = False) -> Path:
        if (arch, index_only) not in pulled:
            home = tmp_path_factory.mktemp(f"pulled-{arch}{'-index' if index_only else ''}")
            with HubServer(hub_root) as server, hub_client.using_endpoint(server.url):
                pull(tiny_id(arch), home=home, progress=False, index_only=index_only)
            pulled[arch, index_only] = home
        shutil.copytree(pulled[arch, index_only], dest, dirs_exist_ok=True)
        return dest

    return make


@pytest.fixture(scope="module")
def module_home(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This module's home with tiny kimi_k3 pulled, its experts served by the module's Hub. The
    module's tests share it, and whatever a node caches in it; a test that needs a home of its own
    takes `home`."""
    return pulled_home("kimi_k3", tmp_path_factory.mktemp("module-home"))


@pytest.fixture
def home(pulled_home, hub: HubServer, tmp_path: Path) -> Path:
    """This test's own home (tmp_path/home) with tiny kimi_k3 pulled and nothing cached, its experts
    served by the module's Hub. A module may define its own `home`, which then takes its place."""
    return pulled_home("kimi_k3", tmp_path / "home")


@pytest.fixture(scope="session", autouse=True)
def loopback_mdns_timing() -> Iterator[None]:
    """zeroconf's RFC 6762 timing, shortened for the responders this test process runs itself.

    Registering a service waits 150-250 ms, sends three probes 500 ms apart and then three
    announcements 225 ms apart: 1.6 s a node, which keeps strangers on a real LAN from taking a
    name, but on loopback, where every responder is this run's own, it is only waiting (about a
    third of test_discovery.py's time). The same probes, conflict checks, announcements and
    goodbyes are still sent, and nodes a test starts as processes keep the library's timing.
    """
    from zeroconf import _core

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_core, "_PROBE_RANDOM_DELAY_INTERVAL", (5, 10))
        patch.setattr(_core, "_CHECK_TIME", 20)
        patch.setattr(_core, "_REGISTER_TIME", 20)
        patch.setattr(_core, "_UNREGISTER_TIME", 20)
        yield


@pytest.fixture(scope="module")
def own_service_type() -> Iterator[str]:
    """For the module: this process advertises and browses zeroconf under a service type of its own
    (tests/loopback.py), so neither another run's names nor its advertisements reach it."""
    from expertmesh.node.household import discovery

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(discovery, "SERVICE_TYPE", loopback.SERVICE_TYPE)
        yield loopback.SERVICE_TYPE


class Oracle:
    """mlx-lm itself, on the whole tiny repo in memory: what streamed generation must equal.
    Each model is loaded once per session; greedy token lists are remembered."""

    def __init__(self, repos: dict[str, Path]):
        self.repos = repos
        self._models: dict[str, tuple] = {}
        self._tokens: dict[tuple, list[int]] = {}

    def load(self, arch: str) -> tuple:
        """(model, tokenizer). BF16 experts run in float32 here, as the streamed model runs them on
        a CPU (MLX's CPU gather_mm computes float32 only), so the two compare."""
        if arch not in self._models:
            model, tokenizer = mlx_lm.load(str(self.repos[arch]))
            if arch in DENSE_EXPERT_ARCHS and not mx.metal.is_available():
                model.set_dtype(mx.float32)
            self._models[arch] = (model, tokenizer)
        return self._models[arch]

    def tokens(self, arch: str, prompt: str | list[int], max_tokens: int) -> list[int]:
        """Greedy token ids (the end-of-sequence token, which is no output, left out)."""
        key = (arch, prompt if isinstance(prompt, str) else tuple(prompt), max_tokens)
        if key not in self._tokens:
            model, tokenizer = self.load(arch)
            feed = prompt if isinstance(prompt, str) else mx.array(prompt)
            self._tokens[key] = [
                r.token
                for r in mlx_lm.stream_generate(model, tokenizer, feed, max_tokens=max_tokens)
                if r.finish_reason != "stop"
            ]
        return list(self._tokens[key])

    def text(self, arch: str, prompt: str, max_tokens: int) -> str:
        model, tokenizer = self.load(arch)
        return mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens)


@pytest.fixture(scope="session")
def oracle(tiny_repos: dict[str, Path]) -> Oracle:
    return Oracle(tiny_repos)
