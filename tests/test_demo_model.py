"""The trained demo model: deterministic repo bytes, loads in mlx-lm, writes text, routes unevenly."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import mlx_lm
import pytest
from safetensors import safe_open

from expertmesh.devtools.tiny import demo_model
from expertmesh.devtools.tiny.demo_model import make_demo_model


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("hub") / "expertmesh" / "demo-kimi-k3")


@pytest.fixture(scope="module")
def loaded(demo_repo: Path):
    return mlx_lm.load(str(demo_repo))


def _heldout(tok, n_windows: int):
    ids = tok.encode((demo_model.DEMO_DIR / demo_model.HELDOUT_FILE).read_text(encoding="utf-8"))
    return demo_model.windows(ids)[:n_windows]


def test_same_bytes_every_time(demo_repo: Path, tmp_path: Path) -> None:
    again = make_demo_model(tmp_path / "again")
    assert _digests(again) == _digests(demo_repo)
    assert not list(tmp_path.glob(".*partial"))


def test_upstream_kimi_k3_layout(demo_repo: Path) -> None:
    config = json.loads((demo_repo / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    index = json.loads((demo_repo / "model.safetensors.index.json").read_text())
    names = index["weight_map"]
    assert "model.layers.1.block_sparse_moe.experts.31.w2.weight_packed" in names
    assert "model.layers.3.self_attn.kv_b_proj.weight" in names  # MLA, folded as upstream
    assert not any("switch_mlp" in n for n in names)
    assert len(set(names.values())) >= 3  # sharded by layers
    shard = demo_repo / names["model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    with safe_open(shard, "numpy") as f:
        assert f.get_slice("model.layers.1.block_sparse_moe.experts.0.w1.weight_packed").get_dtype() == "U8"
    generation = json.loads((demo_repo / "generation_config.json").read_text())
    tokenizer = json.loads((demo_repo / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]  # a docstring's end ends a reply


def test_greedy_output_is_text(loaded) -> None:
    model, tok = loaded
    # it ends a docstring with <|endoftext|> (an end of sequence), so ask for a few
    prompts = ("Create a new", "The optional argument", "If the file", "Return the")
    text = " ".join(mlx_lm.generate(model, tok, p, max_tokens=40) for p in prompts)
    assert len(text) >= 40
    texty = sum(c.isascii() and (c.isalpha() or c in " \n.,;:'\"()-") for c in text)
    assert texty >= 0.8 * len(text), text
    words = [w for w in text.split() if w.isalpha()]
    assert len(words) >= 5, text


def test_held_out_loss_well_below_uniform(loaded) -> None:
    model, tok = loaded
    loss = demo_model.mean_loss(model, _heldout(tok, 6))
    assert loss < 0.6 * math.log(demo_model.VOCAB_SIZE), loss


def test_routing_is_skewed(loaded) -> None:
    """Trained without a balancing loss, a few experts take most tokens (uniform would be 0.25)."""
    model, tok = loaded
    counts = demo_model.expert_counts(model, _heldout(tok, 6))
    assert len(counts) == 5
    shares = [demo_model.top_quarter_share(c) for c in counts.values()]
    assert sum(shares) / len(shares) > 0.4, shares
