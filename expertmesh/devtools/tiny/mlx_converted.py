"""A tiny MLX-converted repo: the Qwen3-MoE fixture run through `mlx_lm.convert` (affine
4-bit, group 32), so each projection stacks all experts of a layer in one tensor
(`model.layers.{l}.mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}`) and an expert
is a slice of each: the layout of the mlx-community repos."""

from __future__ import annotations

import contextlib
import io
import shutil
import tempfile
from pathlib import Path

import mlx_lm

from expertmesh.devtools.tiny import qwen3_moe
from expertmesh.devtools.tiny.common import write_readme


def build(out: Path, seed: int) -> None:
    """Write the repo files of a tiny MLX-converted Qwen3-MoE into `out`."""
    with tempfile.TemporaryDirectory() as tmp:
        upstream = Path(tmp) / "upstream"
        upstream.mkdir()
        qwen3_moe.build(upstream, seed)
        converted = Path(tmp) / "converted"
        with contextlib.redirect_stdout(io.StringIO()):
            mlx_lm.convert(str(upstream), mlx_path=str(converted), quantize=True, q_group_size=32, q_bits=4)
        for path in converted.iterdir():
            shutil.copy2(path, out / path.name)
    write_readme(out, "qwen3_moe, MLX 4-bit", seed, "layout of mlx-community conversions (stacked experts).")
