"""The prefix cache through the API, as a user meets it (issue 45): the official `openai` client
chats with a node whose API needs keys; each turn after the first reports what it reused in
`usage.prompt_tokens_details.cached_tokens` and feeds only its new tokens, and a stored prefix
is never reused by another key (whose first request of the same conversation then replies
exactly as the reusing one did)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lazy_import import lazy_import
from repos import KIMI_K3

from expertmesh.assembly import build_node
from expertmesh.coordinator.api_access import api_keys_path
from expertmesh.node.config import ApiConfig, HouseholdConfig, NodeConfig, RpcConfig, StoreConfig

openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)

SECRET = "prefix-cache-api-secret"
KEYS = ("key-one-" + "a" * 24, "key-two-" + "b" * 24)
IO_TIMEOUT_S = 120
TURNS = ("Name three colours.", "And three animals?", "Which one is fastest?")
SYSTEM = "You answer in few words. " * 6
MORE = 16  # what a turn may feed beyond its new tokens


@pytest.fixture(scope="module")
def node(module_home: Path, hub):
    path = api_keys_path(module_home)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, ("\n".join(KEYS) + "\n").encode())
    os.close(fd)
    config = NodeConfig(
        KIMI_K3,
        home=module_home,
        node_id="prefix-cache-api-node",
        store=StoreConfig(prefetch=False),
        household=HouseholdConfig(secret=SECRET),
        rpc=RpcConfig(host="127.0.0.1", port=0),
        api=ApiConfig(host="0.0.0.0", port=0),
        max_batch=2,  # the batch engine: rows start from stored prefixes too
    )
    with build_node(config).start() as node:
        yield node


def _client(node, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{node.api.port}/v1", api_key=key, max_retries=0, timeout=IO_TIMEOUT_S
    )


def _ask(client: openai.OpenAI, messages: list[dict]):
    return client.chat.completions.create(model=KIMI_K3, messages=messages, max_tokens=6, temperature=0)


def test_a_chat_reuses_its_turns_within_its_key_only(node) -> None:
    one, two = (_client(node, k) for k in KEYS)
    messages = [{"role": "system", "content": SYSTEM}]
    usages = []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        r = _ask(one, messages)
        usages.append(r.usage)
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    for before, now in zip(usages, usages[1:]):
        cached = now.prompt_tokens_details.cached_tokens
        assert cached > 0
        # the new tokens: at least what this turn's prompt adds to the last one's prompt and reply
        new = now.prompt_tokens - before.prompt_tokens - before.completion_tokens
        assert now.prompt_tokens - cached <= new + MORE, (before, now)
    # the other key's first sight of the same conversation reuses nothing and replies the same
    last = messages[:-1]
    fresh = _ask(two, last)
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert fresh.choices[0].message.content == messages[-1]["content"]
    again = _ask(two, last)  # ...and its own prefix is its own to reuse
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.content == fresh.choices[0].message.content
