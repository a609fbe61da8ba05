"""A node whose sampler can be made to write a given text: random tiny weights never write a tool
call, so a test that needs one forces its tokens through the sampler (a TokenConstraint that
allows one token at each step, then the end of the sequence), on the node's real Generate path."""

from __future__ import annotations

import mlx.core as mx

from expertmesh.node.service import NodeService

FORCE_MARK = "FORCE:"  # a last user message "FORCE:<text>" makes the reply exactly <text>


class ForcedTokens:
    """Allows exactly `ids`, one a step, then only `eos`."""

    def __init__(self, ids: list[int], eos: int):
        self.ids, self.eos, self.step = ids, eos, 0

    def mask(self, logprobs: mx.array) -> mx.array:
        allowed = self.ids[self.step] if self.step < len(self.ids) else self.eos
        keep = mx.arange(logprobs.shape[-1]) == allowed
        return mx.where(keep, logprobs, -mx.inf)

    def advance(self, token: int) -> None:
        self.step += 1


class ForcingService(NodeService):
    """NodeService whose replies to a "FORCE:<text>" message are <text>, tokenised as the model's
    tokenizer would (its markup tokens included)."""

    def _constraint(self, sm, request, fmt, tools, context):
        last = request.messages[-1].content if request.messages else ""
        if not last.startswith(FORCE_MARK):
            return super()._constraint(sm, request, fmt, tools, context)
        tok = sm.tokenizer
        ids = tok.encode(last[len(FORCE_MARK) :], add_special_tokens=False)
        return ForcedTokens(ids, next(iter(tok.eos_token_ids)))
