"""Tiny Mixture-of-Experts repos in the upstream layouts, made deterministically from a seed.

No machine here reaches the Hub, so tests and demos run on these: each is small enough for a
CPU, and each has enough experts (≥ 32 per MoE layer, top-k ≥ 4, ≥ 4 MoE layers) that
routing is not trivial. `mlx_lm.load` loads every one of them; that is the oracle.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from expertmesh.devtools.tiny import deepseek_v3, kimi_k3, mlx_converted, qwen3_moe

ARCHS: dict[str, Callable[[Path, int], None]] = {
    "kimi_k3": kimi_k3.build,
    "deepseek_v3": deepseek_v3.build,
    "qwen3_moe": qwen3_moe.build,
    "mlx_qwen3_moe": mlx_converted.build,
}


def make_tiny_model(out: Path, arch: str, seed: int = 0) -> Path:
    """Write a tiny repo of architecture `arch` into `out` (replacing what was there).

    The repo is built in a sibling folder and moved into place, so an interrupted run
    never leaves a half-written model that looks complete.

    Raises:
        ValueError: `arch` is not one of `ARCHS`.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {', '.join(ARCHS)}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    ARCHS[arch](staging, seed)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
