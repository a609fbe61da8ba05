"""A model loaded on one thread generates on another, as `serve` does (the model is loaded at
start, Generate runs on a gRPC worker): on a machine without Metal, BF16 experts make the core
float32, and that cast must not be left lazy on the loading thread's stream."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from repos import tiny_id

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import Generator, SamplingSettings


@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_a_model_loaded_on_one_thread_generates_on_another(
    arch: str, pulled_home, hub: HubServer, tmp_path: Path
) -> None:
    home = pulled_home(arch, tmp_path / "home")
    sm = open_model(tiny_id(arch), home=home, store=StoreConfig(prefetch=False, fill=False))
    try:
        ids = sm.tokenizer.encode("one thread loads, another generates")
        got: list = []

        def generate() -> None:
            try:
                got.append([t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=4))])
            except Exception as e:  # noqa: BLE001 - asserted below, with its message
                got.append(e)

        worker = threading.Thread(target=generate)
        worker.start()
        worker.join(120)
        assert got and isinstance(got[0], list) and len(got[0]) == 4, got
    finally:
        sm.close()
