"""The tiny repos' ids, one name each: tests/conftest.py makes the repos and the local Hub serves
them under these ids."""

from __future__ import annotations


def tiny_id(arch: str) -> str:
    """The id of the tiny repo of `arch` (expertmesh/devtools/tiny/)."""
    return f"expertmesh/tiny-{arch}"


KIMI_K3 = tiny_id("kimi_k3")  # the default: KDA and MLA attention, quantised experts, most tests use it
QWEN3_MOE = tiny_id("qwen3_moe")  # BF16 experts, plain attention
MLX_QWEN3_MOE = tiny_id("mlx_qwen3_moe")  # an mlx-lm conversion: its core is 4-bit already
