"""Quantising a pulled core in place is crash-safe (node/engine/core_replacement.py): stopped at
each moment between its steps, the folder is the BF16 pull or the finished quantised core. `run`
loads whichever it is, token for token, and the next `pull --core-bits` finishes the job.

Before the commit point the quantisation is stopped by a test hook that raises (the MLX work of
quantising runs in this process); after it, the roll-forward — renames only, no MLX — runs in a
process of its own that SIGKILLs itself at the moment tested."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from repos import KIMI_K3

from expertmesh.assembly import open_model
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine import core_replacement
from expertmesh.node.engine.core_quantization import pull_with_core_bits
from expertmesh.node.engine.generation import Generator, SamplingSettings
from expertmesh.node.hub import local_models

TOKENS = 4

_KILL_AT = """
import os, signal, sys
from pathlib import Path
from expertmesh.node.engine import core_replacement
point, nth, seen = sys.argv[2], int(sys.argv[3]), [0]
def crash_point(name):
    if name == point:
        seen[0] += 1
        if seen[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
core_replacement.crash_point = crash_point
core_replacement.finish_replacement(Path(sys.argv[1]))
"""


class _Stopped(BaseException):
    """What the hook raises: nothing in the quantisation catches it, as nothing survives a kill."""


def _tokens(home: Path) -> tuple[int, list[int]]:
    sm = open_model(KIMI_K3, home=home, store=StoreConfig(fill=False, prefetch=False))
    try:
        ids = sm.tokenizer.encode("a crash at any point")
        return sm.core_bits, [t.id for t in Generator(sm).generate(ids, SamplingSettings(max_tokens=TOKENS))]
    finally:
        sm.close()


@pytest.fixture(scope="module")
def pulled(pulled_home, hub: HubServer, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The BF16 pull, and the tokens of its BF16 and of its 4-bit core, quantised without a crash."""
    bf16 = pulled_home("kimi_k3", tmp_path_factory.mktemp("bf16"))
    q4 = tmp_path_factory.mktemp("q4")
    shutil.copytree(bf16, q4, dirs_exist_ok=True)
    pull_with_core_bits(KIMI_K3, home=q4, progress=False, core_bits=4)
    return {"home": bf16, 16: _tokens(bf16), 4: _tokens(q4)}


def _stop_at(monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    def crash_point(name: str) -> None:
        if name == point:
            raise _Stopped(name)

    monkeypatch.setattr(core_replacement, "crash_point", crash_point)


def test_stopped_before_the_commit_point_it_is_the_bf16_pull(pulled, hub, tmp_path: Path, monkeypatch) -> None:
    home = tmp_path / "home"
    shutil.copytree(pulled["home"], home)
    _stop_at(monkeypatch, "staged")  # every quantised file written and synced, not yet committed
    with pytest.raises(_Stopped):
        pull_with_core_bits(KIMI_K3, home=home, progress=False, core_bits=4)
    path = local_models.find_pulled(home, KIMI_K3)
    assert (path / core_replacement.STAGING).is_dir()
    assert _tokens(home) == pulled[16]  # run loads the BF16 core beside the staged one
    monkeypatch.undo()
    result = pull_with_core_bits(KIMI_K3, home=home, progress=False, core_bits=4)
    assert result.core_bits == 4 and not (path / core_replacement.STAGING).exists()
    assert _tokens(home) == pulled[4]


@pytest.mark.parametrize(
    ("point", "nth"),
    [  # a kill needs a process of its own: those are e2e
        ("ready", 0),
        *(
            pytest.param(point, nth, marks=pytest.mark.e2e)
            for point, nth in [("removed", 1), ("removed", 3), ("installed", 1), ("marked", 1)]
        ),
    ],
    ids=["committed", "one-bf16-shard-gone", "all-bf16-gone", "one-file-installed", "marked"],
)
def test_killed_after_the_commit_point_run_finishes_the_4_bit_core(
    point: str, nth: int, pulled, hub, tmp_path: Path, monkeypatch
) -> None:
    home = tmp_path / "home"
    shutil.copytree(pulled["home"], home)
    _stop_at(monkeypatch, "ready")  # committed: `.core-ready/` holds the manifest and the files
    with pytest.raises(_Stopped):
        pull_with_core_bits(KIMI_K3, home=home, progress=False, core_bits=4)
    monkeypatch.undo()
    path = local_models.find_pulled(home, KIMI_K3)
    if nth:
        r = subprocess.run([sys.executable, "-c", _KILL_AT, str(path), point, str(nth)], timeout=60)
        assert r.returncode == -signal.SIGKILL, f"not killed at {point} #{nth}"
    assert (path / core_replacement.READY).is_dir()
    assert _tokens(home) == pulled[4]  # `run` completes the replacement before it loads anything
    assert not (path / core_replacement.READY).exists()
    assert [p.name for p in path.glob("model*.safetensors")] == ["model-core-q4-00001-of-00001.safetensors"]
    assert not os.path.exists(path / (local_models.COMPLETE_MARKER + ".tmp"))
