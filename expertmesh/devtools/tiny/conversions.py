"""Tiny repos as Mac users download them: a registry repo run through mlx-lm's own `convert -q`
(what mlx-community publishes), at each bit width, mixed recipe and mode it offers, and the
comparison of a streamed run of one with mlx-lm's run of the same folder.

tests/test_mlx_conversions.py runs a few architectures over every entry of `QUANTS`;
benchmarks/bench_conversions.py runs every architecture of the registry that streams.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from expertmesh.assembly import open_model
from expertmesh.devtools.tiny import registry
from expertmesh.node.config import StoreConfig
from expertmesh.node.engine.generation import GenerationSummary, Generator, SamplingSettings
from expertmesh.node.hub.pull import pull

# name -> the arguments of `mlx_lm.convert(..., quantize=True)`, as its command line takes them:
# `-q --q-bits N`, `-q --quant-predicate RECIPE` (affine, the recipe's low and high bits), `-q
# --q-mode MODE` (each mode's own bits and group size). Group sizes are left to mlx-lm's default
# (64 for affine), except one affine row at 32, the group the tiny MLX fixture uses.
QUANTS: dict[str, dict] = {
    "2bit": {"q_bits": 2},
    "3bit": {"q_bits": 3},
    "4bit": {"q_bits": 4},
    "4bit_g32": {"q_bits": 4, "q_group_size": 32},
    "6bit": {"q_bits": 6},
    "8bit": {"q_bits": 8},
    "mixed_2_6": {"quant_predicate": "mixed_2_6"},
    "mixed_3_4": {"quant_predicate": "mixed_3_4"},
    "mixed_3_6": {"quant_predicate": "mixed_3_6"},
    "mixed_4_6": {"quant_predicate": "mixed_4_6"},
    "mxfp4": {"q_mode": "mxfp4"},
    "nvfp4": {"q_mode": "nvfp4"},
    "mxfp8": {"q_mode": "mxfp8"},
}

PROMPTS = ("hello experts", "w0 and w1 and w2")
MAX_TOKENS = 8


def convert(upstream: Path, out: Path, quant: str) -> Path:
    """Write `mlx_lm.convert -q` of the repo at `upstream` with `QUANTS[quant]` into `out` (which
    must not exist: convert refuses to write over a folder)."""
    with contextlib.redirect_stdout(io.StringIO()):
        mlx_lm.convert(str(upstream), mlx_path=str(out), quantize=True, **QUANTS[quant])
    return out


def build_upstream(out: Path, arch: str, **sizes: int) -> registry.Made:
    """The registry's tiny repo of `arch` in `out`, with `sizes` replacing its tiny widths (a
    wider expert makes every projection one mlx-lm's default group divides), its config saying
    `torch_dtype: bfloat16` as makers' configs do: `convert` casts to that dtype, so a parameter
    the tiny repo keeps in float32 (mimo_v2_flash's attention sinks) is converted as a published
    one is.

    Raises:
        ValueError: as `registry.build`.
    """
    made = registry.build(out, arch, sizes=sizes)
    config = json.loads((out / "config.json").read_text())
    config.setdefault("torch_dtype", "bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return made


@dataclass
class Comparison:
    """A streamed run of a pulled repo beside mlx-lm's run of the same folder."""

    streamed: list[int]
    mlx_lm: list[int]
    from_hub: int  # expert uses served from the Hub: a run that streamed nothing proves nothing
    dense: tuple[str, ...]  # the expert projections the conversion left unquantised
    float32: bool  # run in float32, both (a CPU, with an unquantised expert projection)

    @property
    def equal(self) -> bool:
        return bool(self.mlx_lm) and self.streamed == self.mlx_lm


class MlxLmFails(Exception):
    """mlx-lm itself cannot run the folder on this machine: there is nothing to compare with."""


def compare(repo_id: str, folder: Path, home: Path) -> Comparison:
    """Pull `repo_id` (served by a Hub the caller points huggingface_hub at) into `home`, run
    mlx-lm on `folder`, the same repo, as it loads it, then stream the same prompt greedily. Where
    the streamed model runs in float32 (a CPU, with an unquantised expert or switch layer)
    mlx-lm's model is cast as ours is. A prompt whose first token mlx-lm says is the end (a 2-bit
    model can) gives way to the next of `PROMPTS`, so tokens are compared, not two empty lists.

    Raises:
        UnsupportedModelError: `pull` or loading the pulled model refused the repo.
        MlxLmFails: mlx-lm's own run raised (its message).
    """
    pull(repo_id, home=home, progress=False)
    sm = open_model(repo_id, home=home, store=StoreConfig(ram_budget="50%", prefetch=False, fill=False))
    try:
        dense_dtype = sm.codec.dense_dtype
        dense = sorted(
            {
                name
                for layer in sm.index.moe_layers
                for name, _, quant in sm.codec.layout(sm.index.expert(layer, 0)).projections
                if quant is None
            }
        )
        loaded = mlx_lm.load(str(folder))
        ref, tokenizer = loaded[0], loaded[1]
        if dense_dtype is not None:
            ref.set_dtype(dense_dtype)
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            try:
                expected = _mlx_lm_tokens(ref, tokenizer, ids)
            except (RuntimeError, ValueError) as e:
                raise MlxLmFails(f"{type(e).__name__}: {e}") from e
            if expected:
                break
        summary = GenerationSummary()
        settings = SamplingSettings(max_tokens=MAX_TOKENS, temp=0.0)
        got = [t.id for t in Generator(sm).generate(ids, settings, lambda: False, summary)]
    finally:
        sm.close()
    return Comparison(got, expected, summary.experts.uses["hub"], tuple(dense), dense_dtype is not None)


def _mlx_lm_tokens(model, tokenizer, ids: list[int]) -> list[int]:
    out = []
    sampler = make_sampler(0.0)
    for r in mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=MAX_TOKENS, sampler=sampler):
        if r.finish_reason == "stop":
            break
        out.append(r.token)
    return out
