"""Give a random model's routers the even load a trained MoE's have.

A freshly initialised router is skewed: the tokens' router inputs share a common direction, so
the same few dozen experts win for almost every token. Measured on the K3-proportioned model
(384 experts a layer, top-16): after a short prompt a greedy decode layer asked for about 4 experts
it had not used yet, where an even router asks for about 10. A trained K3 is even — DeepSeek-V3's
auxiliary-loss-free balancing, which K3 keeps, learns a per-expert `e_score_correction_bias`
added to the router's scores for selection only — so a benchmark on the raw router measures a
regime K3 never runs in (most of a layer's experts already held).

`balance_routers` does what that training does, on random tokens: layer by layer, it nudges each
expert's bias up while it is chosen less than its share and down while more, until every expert
is chosen about equally often. The routed experts are stood in by zeros while it runs: K3-sized
experts are never materialised by the maker, and the bias only has to undo the router's own skew.
So the first MoE layer comes out even (busiest expert ≈ 1.3–1.5× the mean on unseen tokens) and
later ones less so (≈ 1.9×, their inputs carry the real experts' outputs), where the raw router's
busiest expert has 4–7× the mean and several experts are never chosen.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

CALIBRATION_LENGTH = 64  # tokens a sequence
CHOICES_PER_EXPERT = 32  # enough calibration tokens that each expert is chosen about this often
STEPS = 200


class _NoRoutedExperts(nn.Module):
    """The routed experts' place while calibrating: an output of zeros of the right shape."""

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return mx.zeros((*x.shape[:-1], indices.shape[-1], x.shape[-1]), dtype=x.dtype)


class _RecordedRouter(nn.Module):
    """A router that keeps what it computed, so the calibration sees each layer's real scores."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.router = router
        self.seen: list[mx.array] = []

    def __call__(self, x: mx.array) -> mx.array:
        out = self.router(x)
        self.seen.append(out)
        return out


def even_bias(scores: np.ndarray, top_k: int, steps: int = STEPS) -> np.ndarray:
    """A per-expert bias under which top-k of (scores + bias) picks every expert about equally.

    A proportional form of DeepSeek-V3's sign update: each step moves an expert's bias by its
    relative under- or over-load, with a step that shrinks so the loads converge.
    """
    positions, experts = scores.shape
    share = positions * top_k / experts
    bias = np.zeros(experts, dtype=np.float32)
    step = 0.5 * float(scores.std()) or 1e-3
    for _ in range(steps):
        chosen = np.argpartition(-(scores + bias), top_k - 1, axis=1)[:, :top_k]
        load = np.bincount(chosen.ravel(), minlength=experts)
        bias += step * (share - load) / share
        step *= 0.98
    return bias


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks with a sigmoid router and a selection bias, in layer order."""
    return [
        layer.mlp
        for layer in model.layers
        if hasattr(getattr(layer, "mlp", None), "e_score_correction_bias") and hasattr(layer.mlp, "gate")
    ]


def balance_routers(model: nn.Module, vocab_size: int, top_k: int, seed: int = 0) -> None:
    """Set every MoE block's `e_score_correction_bias` so its experts share the load evenly.

    The model's modules are put back as they were; only the biases change.
    """
    blocks = moe_blocks(model)
    if not blocks:
        return
    experts = blocks[0].e_score_correction_bias.shape[0]
    sequences = max(4, -(-CHOICES_PER_EXPERT * experts // (top_k * CALIBRATION_LENGTH)))
    tokens = mx.array(np.random.default_rng(seed).integers(0, vocab_size, (sequences, CALIBRATION_LENGTH)))
    kept = [(b.gate, b.switch_mlp) for b in blocks]
    try:
        for b in blocks:  # zeros in the experts' place also make every router's input independent
            b.switch_mlp = _NoRoutedExperts()  # of the biases, so one pass serves every layer
            b.gate = _RecordedRouter(b.gate)
        mx.eval(model(tokens))
        seen = [b.gate.seen[0] for b in blocks]
    finally:
        for b, (router, routed) in zip(blocks, kept):
            b.gate, b.switch_mlp = router, routed
    for b, raw in zip(blocks, seen):
        scores = np.array(mx.sigmoid(raw.astype(mx.float32)).reshape(-1, raw.shape[-1]))
        b.e_score_correction_bias = mx.array(even_bias(scores, top_k))
