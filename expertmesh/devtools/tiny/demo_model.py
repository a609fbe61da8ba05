"""The demo model: a tiny Kimi K3 with trained weights, in the layout Moonshot publishes.

The random-weight fixtures (`node.tiny.kimi_k3`) route almost uniformly and generate noise.
This one was trained (by `scripts/train_demo_model.py`, once; see `demo/PROVENANCE.md`) on
English docstrings of Python's standard library, so it writes text and, with no balancing loss,
routes with the skew of a real model: some experts are hot, many are cold. Its weights, tokenizer
and provenance are committed in `expertmesh/devtools/tiny/demo/`; `make_demo_model` turns them into a Hub repo
with the same tensor names, mxfp4 routed experts and shards as the fixture, byte for byte the
same every time. Its draft model for speculative decoding (a tiny dense Llama distilled from it,
`draft/`) is published next to it by `make_draft_model`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from expertmesh.devtools.tiny import kimi_k3
from expertmesh.devtools.tiny.common import write_json
from expertmesh.node import constants

DEMO_DIR = Path(__file__).with_name("demo")
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HELDOUT_FILE = "heldout.txt"  # validation docstrings, never trained on, separated by <|endoftext|>
VOCAB_SIZE = 1024
SEQ_LEN = 128  # the training sequence length
REPO_ID = constants.DEMO_REPO
# The demo's draft model for `--speculate draft`: a tiny dense mlx-lm Llama distilled from it
# (scripts/train_draft_model.py; see draft/PROVENANCE.md), committed as the folder mlx-lm loads.
DRAFT_DIR = Path(__file__).with_name("draft")
DRAFT_REPO_ID = constants.DEMO_DRAFT_REPO


def config() -> dict:
    """The fixture's Kimi K3 config with the demo's vocabulary; everything else is the same."""
    cfg = kimi_k3.config()
    cfg["text_config"]["vocab_size"] = VOCAB_SIZE
    return cfg


def load_params(demo_dir: Path = DEMO_DIR) -> dict[str, mx.array]:
    """The committed trained parameters, by mlx-lm's names without `language_model.`."""
    weights = mx.load(str(demo_dir / WEIGHTS_FILE))
    if not isinstance(weights, dict):
        raise ValueError(f"{demo_dir / WEIGHTS_FILE} holds no named tensors")
    return weights


def write_repo(out: Path, params: dict[str, mx.array], demo_dir: Path = DEMO_DIR) -> None:
    """Write the repo files of the demo model from `params` into the empty folder `out`."""
    cfg = config()
    params = {k: v.astype(mx.float32) for k, v in params.items()}  # bf16 -> f32 is exact
    kimi_k3.write_weights(out, params, cfg)
    write_json(out / "config.json", cfg)
    for name in TOKENIZER_FILES:
        shutil.copyfile(demo_dir / name, out / name)
    eos = json.loads((demo_dir / "tokenizer_config.json").read_text())["eos_token"]
    added = json.loads((demo_dir / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in added}
    # It was trained on docstrings separated by <|endoftext|>: that ends an answer too.
    write_json(out / "generation_config.json", {"eos_token_id": [ids[eos], ids["<|endoftext|>"]], "do_sample": False})
    (out / "README.md").write_text(
        "# demo Kimi K3 (trained, tiny)\n\n"
        "A tiny Kimi K3 in the layout of moonshotai/Kimi-K3 (mxfp4 routed experts), trained by\n"
        "expertmesh's `scripts/train_demo_model.py` on docstrings of the Python 3.11 standard\n"
        "library (PSF License Version 2). It writes docstring-like English and routes unevenly,\n"
        "like a real MoE. For demos and benchmarks: it knows nothing.\n\n"
        "Training text: Copyright (c) 2001, 2002, 2003, 2004, 2005, 2006, 2007, 2008, 2009, 2010, 2011,\n"
        "2012, 2013, 2014, 2015, 2016, 2017, 2018, 2019, 2020, 2021, 2022, 2023 Python Software\n"
        "Foundation; All Rights Reserved. Sources, licence and training: expertmesh's\n"
        "expertmesh/devtools/tiny/demo/PROVENANCE.md.\n"
    )


def make_demo_model(out: Path) -> Path:
    """Write the demo model's Hub repo into `out` (replacing what was there); same bytes every time.

    Built in a sibling folder and moved into place, so an interrupted run never leaves a
    half-written model that looks complete.
    """
    return _publish(Path(out), lambda staging: write_repo(staging, load_params()))


def make_draft_model(out: Path) -> Path:
    """Write the demo's draft model's repo (the committed `draft/` folder) into `out`, as `make_demo_model`."""
    return _publish(Path(out), lambda staging: shutil.copytree(DRAFT_DIR, staging, dirs_exist_ok=True))


def _publish(out: Path, write) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    write(staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


# --- measuring: used by the training script and the tests ---------------------------------------


def windows(ids: Sequence[int], seq_len: int = SEQ_LEN) -> mx.array:
    """Non-overlapping (seq_len + 1)-token windows of `ids`, as a (n, seq_len + 1) array."""
    n = (len(ids) - 1) // seq_len
    a = np.asarray(ids[: n * seq_len + 1], dtype=np.int32)
    return mx.array(np.stack([a[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)]))


def mean_loss(model: nn.Module, batch: mx.array, chunk: int = 16) -> float:
    """Mean next-token cross-entropy (nats) of `model` over the windows in `batch`."""
    total, count = 0.0, 0
    for i in range(0, batch.shape[0], chunk):
        b = batch[i : i + chunk]
        losses = nn.losses.cross_entropy(model(b[:, :-1]).astype(mx.float32), b[:, 1:], reduction="sum")
        total += float(losses)  # a sum: one real number
        count += b[:, 1:].size
    return total / count


class _RoutingRecorder(nn.Module):
    """Stands in for one MoE block: records which experts each token picks, then runs the block."""

    def __init__(self, moe: nn.Module, sink: list[mx.array]):
        super().__init__()
        self.moe = moe
        object.__setattr__(self, "_sink", sink)  # a plain attribute, not a parameter

    def __call__(self, x: mx.array) -> mx.array:
        from mlx_lm.models.kimi_k3 import _group_expert_select

        a = self.moe.args
        inds, _ = _group_expert_select(
            self.moe.gate(x),
            self.moe.e_score_correction_bias,
            a.num_experts_per_token,
            a.num_expert_group,
            a.topk_group,
            a.routed_scaling_factor,
            a.moe_renormalize,
        )
        self._sink.append(inds)
        return self.moe(x)


def expert_counts(model: nn.Module, batch: mx.array) -> dict[int, np.ndarray]:
    """MoE layer -> how often each expert was picked over every token of `batch` (inputs only)."""
    from mlx_lm.models.kimi_k3 import KimiK3SparseMoE

    layers = model.layers
    sinks: dict[int, list[mx.array]] = {}
    originals = {}
    for i, layer in enumerate(layers):
        if isinstance(layer.mlp, KimiK3SparseMoE):
            originals[i] = layer.mlp
            layer.mlp = _RoutingRecorder(layer.mlp, sinks.setdefault(i, []))
    try:
        for j in range(0, batch.shape[0], 16):
            mx.eval(model(batch[j : j + 16, :-1]), sinks)
    finally:
        for i, moe in originals.items():
            layers[i].mlp = moe
    counts = {}
    for i, picks in sinks.items():
        n = originals[i].args.num_experts
        assert n is not None  # a MoE layer's
        counts[i] = np.bincount(np.concatenate([np.array(p).reshape(-1) for p in picks]), minlength=n)
    return counts


def top_quarter_share(counts: np.ndarray) -> float:
    """The fraction of expert uses that go to the most-used 25% of experts (0.25 if uniform)."""
    top = np.sort(counts)[::-1][: max(1, len(counts) // 4)]
    return float(top.sum() / counts.sum())
