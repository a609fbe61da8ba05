"""Shared fixtures: tiny repos are built once per test session (they are deterministic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from expertmesh.node.devtools.local_hub import HubServer
from expertmesh.node.devtools.tiny import ARCHS, make_tiny_model
from expertmesh.node.hub import client as hub_client


@pytest.fixture(scope="session")
def tiny_repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """arch -> a folder `hub/expertmesh/tiny-<arch>` holding that tiny repo (seed 0)."""
    hub = tmp_path_factory.mktemp("hub")
    return {arch: make_tiny_model(hub / "expertmesh" / f"tiny-{arch}", arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def hub_root(tiny_repos: dict[str, Path]) -> Path:
    """The folder of repos that `expertmesh hub` serves in tests."""
    return next(iter(tiny_repos.values())).parent.parent


@pytest.fixture(scope="module")
def hub(hub_root: Path):
    """A local Hub serving the tiny repos on loopback, with huggingface_hub pointed at it; one per
    test module, so a module's faults and link settings never leak into another's."""
    with HubServer(hub_root) as server, hub_client.using_endpoint(server.url):
        yield server
        server.knobs.faults = []
