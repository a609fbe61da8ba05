"""A constraint on which tokens a generation may sample next: the seam structured output (a grammar,
node/engine/grammar.py) and tool-call tests (a forced token sequence) plug into sampling.

A constraint masks the log-probabilities a sampler sees (`Decoder.sample`, node/engine/sampling.py) and follows each token as it is handed
out (`_TokenBook.emit`, on the plain, speculative and batched paths alike). The logprobs a token
reports stay the model's own: only the sampler sees the mask.

Two consequences for the decoding paths, both because the mask of token n + 1 depends on token n:
the plain path does not build the next pass ahead (its sampler would run before token n is
known), and a constrained request is not speculated (drafts would have to be verified against a
mask per position); batching is unaffected, each row samples with its own constrained sampler.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class TokenConstraint(Protocol):
    def mask(self, logprobs: mx.array) -> mx.array:
        """`logprobs` (1, vocab) with every token the constraint forbids now at -inf."""
        ...

    def advance(self, token: int) -> None:
        """Follow `token`, the one handed out (an end-of-sequence token too)."""
        ...
