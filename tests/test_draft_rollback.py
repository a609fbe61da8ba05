"""A draft model whose cache cannot trim (a sliding window that has wrapped) after rejected drafts.

It started again from the whole context at every rejection: a draft with a small window (tiny
gpt_oss: 64 tokens; gpt-oss-20b: 128) re-read the conversation for each proposal, a cost that grew
with the context. It is now put back as it was before its last drafts and fed only what the
context added, and it proposes what a fresh draft model fed the same context proposes.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import gpt_oss

from expertmesh.devtools.tiny.registry import tiny_config
from expertmesh.node.engine.speculative import ModelDraft

K = 4


@pytest.fixture(scope="module")
def windowed():
    """A tiny gpt_oss (sliding-window layers of 64 tokens) with random weights, and its vocabulary size."""
    mx.random.seed(0)
    config = tiny_config("gpt_oss")
    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model, config["vocab_size"]


def _counting(draft: ModelDraft) -> list[int]:
    """Sizes of every feed of `draft`'s model, as they happen."""
    fed: list[int] = []
    feed = draft._feed

    def counted(tokens: list[int]) -> mx.array:
        fed.append(len(tokens))
        return feed(tokens)

    draft._feed = counted
    return fed


def test_a_wrapped_window_draft_feeds_what_the_context_added_not_the_context(windowed) -> None:
    model, vocab = windowed
    draft = ModelDraft(model, vocab)
    fed = _counting(draft)
    context = [i % 100 + 1 for i in range(200)]  # longer than the window: it wraps
    proposed = draft.propose(context, K).tokens
    for _ in range(8):
        # the target accepted the first draft and chose another token than the second
        context = context + proposed[:1] + [proposed[1] % 100 + 1]
        before = sum(fed)
        proposed = draft.propose(context, K).tokens
        assert not draft.trimmable  # the case in question
        assert sum(fed) - before == 2 + K - 1  # what the context added, then the drafts
        assert proposed == ModelDraft(model, vocab).propose(context, K).tokens  # as from scratch
