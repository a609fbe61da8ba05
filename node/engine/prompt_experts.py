"""An opt-in approximate prompt: fewer of the prompt's experts fetched, the cost said and counted.

A cold prompt on one machine is bounded by its link: every MoE layer wants the union of the
prompt's routings, most of it not on this node. These modes change which experts the *prompt's*
rows use; decoding after the prompt stays exact (the modes act only inside the layer-major
prefill, engine/prefill.py), and the default, `exact`, changes nothing.

- `held`: a prompt row whose chosen expert is not held — in this node's RAM or disk, or on a
  household peer's disk (its inventory: fetched over the LAN, or computed there by remote
  execution, either way no Hub bytes) — is routed to the best-scored held expert the row did not
  choose already, by the layer's own router scores; the substitute takes the replaced expert's
  weight, so the row's weights still sum as the router made them. A layer of which nothing is held fetches what it chose (a prompt never fails for it).
- `drop`: a row's experts that are not held are dropped and the kept ones' weights scaled up to
  the row's whole weight (the router's renormalisation); a row keeping none fetches.
- `keep`: fewer experts per prompt token, nothing fetched: a row keeps only its held choices,
  renormalised as `drop` does; a row holding none of its choices is substituted as `held` does.
  Where `held` computes as many expert uses as the exact prompt (on a CPU, the prompt's time),
  `keep` computes only the held share of them.
- `topp:P`: every row keeps its fewest highest-weighted experts whose weights reach P of the row's
  weight and renormalises; an expert no row keeps is not fetched.
- `budget:SECONDS`: the missing experts are fetched in the order of their summed routed weight
  over the prompt's rows while their bytes fit SECONDS at the link's measured rate (spread evenly
  over the MoE layers still to come); the rest are treated as `held` treats them.

The router's scores are what the layer's MoE module computed for the prompt: while an approximate
prompt runs, the module's `gate` is wrapped to keep its output (the router logits) for the block,
which sees only the chosen ids. A sigmoid router with a score-correction bias (DeepSeek, Kimi)
ranks by sigmoid + bias as it selects; any other ranks by its logits (softmax is monotonic).
A module whose router is not a plain `gate` returning logits cannot be ranked, and its layer runs
exact.

A dropped choice is not computed: `rewrite` says which (row, choice) entries are dropped, and the
layer (engine/prefill.py) gives them no rows in its expert groups and an output of 0.

Counted: the prompt's expert uses (rows × experts per token, every MoE layer) and how many of them
were substituted or dropped (`substituted`): what the summary, the API and the metric say.
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from expertmesh.node.config import PromptExperts
from expertmesh.node.engine.forward_pass import building

__all__ = ["Approximation", "PromptCount", "PromptExperts"]

# the link's rate when nothing has been fetched yet to measure it: the rate the issue plans for
DEFAULT_LINK_BYTES_PER_S = 100e6


@dataclass
class PromptCount:
    """What an approximate prompt did: its expert uses and how many were substituted or dropped."""

    uses: int = 0
    substituted: int = 0
    budget_bytes: int = 0  # what a budget allowed, for the summary

    def line(self) -> str:
        share = self.substituted / self.uses if self.uses else 0.0
        return (
            f"approximate prompt: {self.substituted} of {self.uses} prompt expert uses substituted "
            f"({share:.1%}); decoding exact"
        )


class _RecordingGate(nn.Module):
    """A MoE module's router, its output kept for the module's expert block while a prompt runs."""

    def __init__(self, inner: nn.Module, block: Any, approx: Approximation):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_approx", approx)

    def __call__(self, x: mx.array) -> Any:
        y = self.inner(x)
        step = building()
        guessing = step is not None and step.predicts(self._block.layer)
        if not guessing and isinstance(y, mx.array):  # a next-layer guess is not this layer's pass
            self._approx.logits.setdefault(self._block.layer, []).append(y)
        return y


@dataclass
class Approximation:
    """One prompt's approximation, set on the layer-major gatherer (engine/prefill.py's `LayerMajor.approx`)."""

    spec: PromptExperts
    layers: int  # MoE layers of the model
    count: PromptCount = field(default_factory=PromptCount)
    logits: dict[int, list[mx.array]] = field(default_factory=dict)
    bytes_left: float = 0.0
    layers_done: int = 0
    sigmoid: dict[int, mx.array | None] = field(default_factory=dict)  # layer -> correction bias, sigmoid routers
    # (layer, expert) keys the household's peers hold, as their inventories said when the prompt
    # started: held as this node's own are (a peer serves or computes them without the Hub)
    household: Container[tuple[int, int]] = frozenset()

    @contextmanager
    def routers(self, model: nn.Module, blocks: list) -> Iterator[None]:
        """While inside, each block's MoE module keeps its router logits here."""
        from expertmesh.node.engine.blocks import _module_at

        swapped: list[tuple[Any, nn.Module]] = []
        for block in blocks:
            moe: Any = _module_at(model, block.path.rsplit(".", 1)[0])
            gate = getattr(moe, "gate", None) if isinstance(moe, nn.Module) else None
            if not isinstance(gate, nn.Module):
                continue
            bias = getattr(moe, "e_score_correction_bias", None)
            self.sigmoid[block.layer] = bias if isinstance(bias, mx.array) else None
            moe.gate = _RecordingGate(gate, block, self)
            swapped.append((moe, gate))
        try:
            yield
        finally:
            for moe, gate in swapped:
                moe.gate = gate

    def start(self, store: Any) -> None:
        """The budget in bytes, at the rate the link has shown so far (or the planning default)."""
        if self.spec.mode == "budget":
            stats = store.stats
            secs = stats.fetch_seconds["hub"] + stats.fetch_seconds["peer"]
            got = stats.bytes["hub"] + stats.bytes["peer"]
            rate = got / secs if secs > 0 and got > 0 else DEFAULT_LINK_BYTES_PER_S
            self.bytes_left = self.spec.value * rate
            self.count.budget_bytes = int(self.bytes_left)

    def skip(self, block: Any, parts: list) -> list[mx.array]:
        """A layer run as the prompt chose (every expert resident): its uses counted, its logits let go."""
        self.layers_done += 1
        self.count.uses += sum(int(np.prod(p.indices.shape)) for p in parts)
        return self.logits.pop(block.layer, [])

    def rewrite(
        self, block: Any, store: Any, parts: list
    ) -> tuple[list, list[mx.array | None], list[np.ndarray | None]]:
        """`parts` (one per chunk, engine/prefill.py's `_Parked`) with each row's ids rewritten
        as the mode says; for each part the scale of each (row, choice) output (None: 1), and
        which (row, choice) entries, flattened, are dropped (None: none), not to be computed."""
        logits = self.skip(block, parts)
        shapes = [p.indices.shape for p in parts]
        inds = np.concatenate([np.array(p.indices).reshape(-1, s[-1]) for p, s in zip(parts, shapes)])
        nothing: list[np.ndarray | None] = [None] * len(parts)
        if len(logits) != len(parts) or block.layer not in self.sigmoid:
            return parts, [None] * len(parts), nothing  # no router scores for this layer: exact
        raw = np.concatenate([np.array(lg.astype(mx.float32)).reshape(-1, lg.shape[-1]) for lg in logits])
        bias = self.sigmoid[block.layer]
        if bias is not None:
            probs = 1.0 / (1.0 + np.exp(-raw))
            rank = probs + np.array(bias.astype(mx.float32))
            weights = np.take_along_axis(probs, inds, axis=1)
        else:
            rank = raw
            chosen = np.take_along_axis(raw, inds, axis=1)
            weights = np.exp(chosen - chosen.max(axis=1, keepdims=True))
        new, scale = self._choose(block, store, inds, rank, weights)
        if new is inds:
            return parts, [None] * len(parts), nothing
        out, scales, dropped, at = [], [], [], 0
        for p, s in zip(parts, shapes):
            n = int(np.prod(s[:-1]))
            # the parked chunk as it was (its forward pass, its guess), pointing at the experts chosen instead
            p2 = replace(p, indices=mx.array(new[at : at + n].reshape(s).astype(np.uint32)))
            out.append(p2)
            sc = scale[at : at + n]
            scales.append(None if np.all(sc == 1.0) else mx.array(sc.reshape(*s, 1), dtype=p.x.dtype))
            gone = (sc == 0.0).reshape(-1)
            dropped.append(gone if gone.any() else None)
            at += n
        return out, scales, dropped

    def _choose(
        self, block: Any, store: Any, inds: np.ndarray, rank: np.ndarray, weights: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        mode, layer = self.spec.mode, block.layer
        ones = np.ones(inds.shape, dtype=np.float32)
        if mode == "topp":
            order = np.argsort(-weights, axis=1, kind="stable")
            w = np.take_along_axis(weights, order, axis=1)
            total = w.sum(axis=1, keepdims=True)
            before = np.cumsum(w, axis=1) - w  # the weight kept before each choice
            keep_sorted = before < self.spec.value * total - 1e-12
            keep = np.zeros_like(keep_sorted)
            np.put_along_axis(keep, order, keep_sorted, axis=1)
            return self._drop(inds, weights, keep)
        disk = getattr(store, "disk", None)
        held = np.zeros(rank.shape[1], dtype=bool)
        for e in range(rank.shape[1]):
            key = (layer, e)
            held[e] = key in store.ram or (disk is not None and key in disk) or key in self.household
        if mode == "budget":
            missing = [e for e in np.unique(inds).tolist() if not held[e]]
            importance = {e: float(weights[inds == e].sum()) for e in missing}
            share = self.bytes_left / max(1, self.layers - self.layers_done + 1)
            spent = 0
            for e in sorted(missing, key=lambda e: -importance[e]):
                nbytes = store.index.expert(layer, e).nbytes
                if spent + nbytes > share:
                    break
                spent += nbytes
                held[e] = True
            self.bytes_left -= spent
        if not held.any():
            return inds, ones  # nothing of this layer held: fetch what the prompt chose
        ok = held[inds]
        if ok.all():
            return inds, ones
        if mode == "drop":
            return self._drop(inds, weights, ok)
        if mode == "keep":  # rows holding some of their choices keep those; the others are substituted
            keeps = ok.any(axis=1)
            kept_new, kept_scale = self._drop(inds[keeps], weights[keeps], ok[keeps])
            if keeps.all():
                return kept_new, kept_scale
            new, scale = self._substitute(inds, rank, held, ok, rows=~keeps)
            new[keeps], scale[keeps] = kept_new, kept_scale
            return new, scale
        return self._substitute(inds, rank, held, ok)

    def _substitute(
        self, inds: np.ndarray, rank: np.ndarray, held: np.ndarray, ok: np.ndarray, rows: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """`held`'s rewrite of `rows` (None: all): each choice not held (`~ok`) to the best-ranked
        held expert its row did not choose, with its weight; the other rows as they are."""
        ones = np.ones(inds.shape, dtype=np.float32)
        new = inds.copy()
        score = np.where(held[None, :], rank, -np.inf)
        np.put_along_axis(score, inds, -np.inf, axis=1)  # a row's own choices are not substitutes
        todo = ~ok if rows is None else ~ok & rows[:, None]
        for r, c in zip(*(a.tolist() for a in np.nonzero(todo))):
            best = int(np.argmax(score[r]))
            if not np.isfinite(score[r, best]):
                continue  # every held expert already chosen by this row: fetch
            new[r, c] = best
            score[r, best] = -np.inf
            self.count.substituted += 1
        return new, ones

    def _drop(self, inds: np.ndarray, weights: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drop the choices `keep` says not to, scaling the kept ones to the row's whole weight.
        A dropped choice points at a kept expert of its row with scale 0 (the layer does not
        compute it: `rewrite` lists it as dropped)."""
        keep = keep | ~keep.any(axis=1, keepdims=True)  # a row keeping nothing fetches all it chose
        if keep.all():
            return inds, np.ones(inds.shape, dtype=np.float32)
        total = weights.sum(axis=1, keepdims=True)
        kept = np.where(keep, weights, 0.0).sum(axis=1, keepdims=True)
        scale = np.where(keep, total / np.maximum(kept, 1e-20), 0.0).astype(np.float32)
        first_kept = np.take_along_axis(inds, np.argmax(keep, axis=1)[:, None], axis=1)
        new = np.where(keep, inds, first_kept)
        self.count.substituted += int((~keep).sum())
        return new, scale
