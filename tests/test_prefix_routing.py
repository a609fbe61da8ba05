"""The household's prefix cache (issue 45): with two full nodes behind one API, a conversation's
next turn goes to the node that served its last one, which resumes from the prefix it holds
(`cached_tokens` > 0), even where the least busy node would be the other one; what a node
reports it holds is keys, and another API key's request is never routed to, nor resumes from,
someone else's prefix. Both nodes batch (`serve --max-batch 2`), so the rows that resume are
batched rows."""

from __future__ import annotations

import pytest
from lazy_import import lazy_import
from nodes import serving
from repos import KIMI_K3

from expertmesh.coordinator.api_access import AccessPolicy, KeyRing, key_space
from expertmesh.coordinator.node_pool import NodePool
from expertmesh.coordinator.openai_api import Coordinator, CoordinatorConfig, OpenAIServer
from expertmesh.coordinator.openai_request import Ask, generate_request
from expertmesh.node.rpc.client import NodeClient
from expertmesh.node.rpc.prefix_keys import KEY_BYTES, message_prefix_keys

openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)
anthropic = lazy_import("anthropic")  # on first use, not at collection (tests/lazy_import.py)

SECRET = "prefix-routing-secret"
KEYS = ("route-one-" + "a" * 24, "route-two-" + "b" * 24)
IO_TIMEOUT_S = 120
BATCH = 2


@pytest.fixture(scope="module")
def household(pulled_home, hub, tmp_path_factory):
    homes = [pulled_home("kimi_k3", tmp_path_factory.mktemp(f"route-{i}")) for i in range(2)]
    with (
        serving(KIMI_K3, homes[0], SECRET, node_id="route-a", max_batch=BATCH) as a,
        serving(KIMI_K3, homes[1], SECRET, node_id="route-b", max_batch=BATCH) as b,
    ):
        pool = NodePool([a.rpc.address, b.rpc.address])
        config = CoordinatorConfig(secret=SECRET, models=lambda: [KIMI_K3])
        access = AccessPolicy("127.0.0.1", KeyRing(keys=KEYS))
        server = OpenAIServer(Coordinator(config, pool), "127.0.0.1", 0, access=access).start()
        try:
            yield server, pool, a, b
        finally:
            server.stop()


def _ask(server: OpenAIServer, key: str, messages: list[dict]):
    client = openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=IO_TIMEOUT_S)
    return client.chat.completions.create(model=KIMI_K3, messages=messages, max_tokens=6, temperature=0)


def _info(node):
    client = NodeClient(node.rpc.address, SECRET)
    try:
        return client.info(IO_TIMEOUT_S)
    finally:
        client.close()


def _hits(node) -> int:
    return node.service.prefix.stats.hits


def test_a_turn_goes_to_the_node_holding_its_prefix_and_never_to_another_keys(household) -> None:
    server, pool, a, b = household
    one, two = KEYS
    first = [{"role": "system", "content": "You answer in few words. " * 4}, {"role": "user", "content": "Colours?"}]
    other = [{"role": "system", "content": "You are terse. " * 6}, {"role": "user", "content": "Animals?"}]
    r_first = _ask(server, one, first)  # both idle: the first node in the list
    with pool.using(a.rpc.address), pool.using(a.rpc.address):  # a looks full: `other` starts on b
        r_other = _ask(server, one, other)
    assert r_first.usage.prompt_tokens_details.cached_tokens == 0
    assert r_other.usage.prompt_tokens_details.cached_tokens == 0

    # each node reports keys of what it holds, never tokens or text; b holds `other`'s prefix only
    held = [{p.key: p.tokens for p in _info(n).prefixes_held} for n in (a, b)]
    assert held[0] and all(len(k) == KEY_BYTES for k in held[0])
    keys = message_prefix_keys(generate_request(Ask(KIMI_K3, chat=True, messages=other, prefix_space=key_space(one))))
    assert keys[-1] in held[1] and keys[-1] not in held[0]
    assert 0 < held[1][keys[0]] < held[1][keys[-1]] < r_other.usage.prompt_tokens  # the system prompt's end, the turn's

    # the next turns: both nodes idle, yet each conversation goes back to the node that holds it
    hits_a, hits_b = _hits(a), _hits(b)
    other += [
        {"role": "assistant", "content": r_other.choices[0].message.content or ""},
        {"role": "user", "content": "Fastest?"},
    ]
    r = _ask(server, one, other)
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert (_hits(a), _hits(b)) == (hits_a, hits_b + 1)
    first += [
        {"role": "assistant", "content": r_first.choices[0].message.content or ""},
        {"role": "user", "content": "More?"},
    ]
    r = _ask(server, one, first)
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert (_hits(a), _hits(b)) == (hits_a + 1, hits_b + 1)

    # another key sending the same conversation is routed as a stranger and resumes from nothing
    r = _ask(server, two, other)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # the key's own prefix, through Anthropic's Messages API too (its clients send x-api-key)
    system, *turns = other
    client = anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key=one, max_retries=0)
    m = client.messages.create(model=KIMI_K3, system=system["content"], messages=turns, max_tokens=1)
    assert m.usage.cache_read_input_tokens > 0
