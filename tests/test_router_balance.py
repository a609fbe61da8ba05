"""The K3-proportioned bench model routes like a trained K3: its experts share the load evenly.

A raw random router keeps choosing the same experts, so a benchmark on it would find most of a
decode layer's experts already fetched — a regime K3 never runs in. These tests load the made
repo with mlx-lm (what a node runs) and count which experts its routers choose for tokens the
calibration never saw.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.switch_layers import SwitchGLU

from expertmesh.devtools import bench_k3
from expertmesh.devtools.tiny import k3_proportions, kimi_k3
from expertmesh.devtools.tiny.router_balance import even_bias

SHAPE = dict(moe_layers=2, experts=64, top_k=8, latent=128, intermediate=128, hidden=64)


def _loads(repo: Path) -> list[np.ndarray]:
    """Per MoE layer, how often each expert is chosen over 512 unseen random tokens."""
    model, _ = mlx_lm.load(str(repo))
    chosen: dict[int, list[np.ndarray]] = {}
    original = SwitchGLU.__call__

    def recording(self, x, indices):
        chosen.setdefault(id(self), []).append(np.array(indices).reshape(-1))
        return original(self, x, indices)

    tokens = mx.array(np.random.default_rng(12345).integers(0, kimi_k3.VOCAB_SIZE, (8, 64)))
    SwitchGLU.__call__ = recording
    try:
        mx.eval(model(tokens))
    finally:
        SwitchGLU.__call__ = original
    return [np.bincount(np.concatenate(c), minlength=SHAPE["experts"]) for c in chosen.values()]


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("router")
    return {
        router: k3_proportions.build(root / router, 0, k3_proportions.Proportions(**SHAPE, router=router))
        for router in ("raw", "balanced")
    }


def test_the_balanced_router_spreads_unseen_tokens_evenly_where_the_raw_one_does_not(repos) -> None:
    raw, balanced = _loads(repos["raw"]), _loads(repos["balanced"])
    assert len(raw) == len(balanced) == SHAPE["moe_layers"]
    for layer, (r, b) in enumerate(zip(raw, balanced)):
        # 512 tokens x 8 choices over 64 experts: 64 each when even. The first MoE layer is
        # calibrated on exactly its inputs; later ones on inputs without the routed experts' part
        # (zeros stand in for experts while calibrating), so they are less even, but far more than raw
        assert b.max() / b.mean() < (1.6 if layer == 0 else 2.2), b
        assert (b > 0).all(), b  # no expert is dead
        assert r.max() / r.mean() > 1.5 * b.max() / b.mean(), (r, b)  # the raw router is skewed
        assert (r == 0).sum() > (b == 0).sum()


def test_only_the_selection_biases_differ_between_the_two_routers(repos) -> None:
    """The balanced model is the raw one with a calibrated bias: same core, same experts."""
    from safetensors import safe_open

    def tensors(repo: Path) -> dict[str, np.ndarray]:
        out = {}
        for shard in sorted(repo.glob("*.safetensors")):
            with safe_open(str(shard), "numpy") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
        return out

    raw, balanced = tensors(repos["raw"]), tensors(repos["balanced"])
    assert raw.keys() == balanced.keys()
    differ = {k for k in raw if not np.array_equal(raw[k], balanced[k])}
    assert differ and all(k.endswith("e_score_correction_bias") for k in differ), differ


def test_even_bias_evens_out_a_skewed_router() -> None:
    rng = np.random.default_rng(0)
    scores = rng.random((2048, 96)) + np.linspace(0, 1.5, 96)  # the last experts win nearly always
    before = np.bincount(np.argpartition(-scores, 7, axis=1)[:, :8].ravel(), minlength=96)
    bias = even_bias(scores, 8)
    after = np.bincount(np.argpartition(-(scores + bias), 7, axis=1)[:, :8].ravel(), minlength=96)
    assert before.max() / before.mean() > 3
    assert after.max() / after.mean() < 1.3


def test_a_cached_bench_repo_made_by_another_maker_is_made_again(tmp_path: Path) -> None:
    p = k3_proportions.Proportions(**SHAPE)
    said: list[str] = []
    repo = bench_k3._model_dir(tmp_path / "hub", "expertmesh/k3-test", p, said.append)
    assert any(m.startswith("making") for m in said)
    said.clear()
    assert bench_k3._model_dir(tmp_path / "hub", "expertmesh/k3-test", p, said.append) == repo
    assert not any(m.startswith("making") for m in said)  # kept for later runs
    (repo.with_name(repo.name + ".made.json")).unlink()  # as a repo of the raw-router maker has none
    bench_k3._model_dir(tmp_path / "hub", "expertmesh/k3-test", p, said.append)
    assert any(m.startswith("making") for m in said)
