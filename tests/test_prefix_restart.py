"""A long prompt prefix outlives a node's restart (issue 45), as a user meets it: an agent's
system prompt of more than 1,024 tokens, sent through the API to a node that is then restarted
on the same home, is not fed again in a new conversation that starts with it; with
`--prefix-disk-budget 0` none is kept on disk. The model's states trim (plain attention), so the one
kept is the first conversation's end, trimmed to the system prompt."""

from __future__ import annotations

from lazy_import import lazy_import
from nodes import api_server, serving
from repos import QWEN3_MOE

from expertmesh.node.engine.prefix_disk import MIN_TOKENS, stored_prefixes

openai = lazy_import("openai")  # on first use, not at collection (tests/lazy_import.py)

SECRET = "prefix-restart-secret"
SYSTEM = "You are an agent with tools: search, fetch, read, write, list and run. " * 24


def _ask(address: str, question: str):
    server = api_server([address], SECRET, [QWEN3_MOE])
    try:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return client.chat.completions.create(model=QWEN3_MOE, messages=messages, max_tokens=1, temperature=0)
    finally:
        server.stop()


def test_a_long_system_prompt_is_not_fed_again_after_a_restart(pulled_home, hub, tmp_path) -> None:
    home = pulled_home("qwen3_moe", tmp_path / "home")
    with serving(QWEN3_MOE, home, SECRET, node_id="restart") as node:
        first = _ask(node.rpc.address, "List the tools.")
    assert first.usage.prompt_tokens > MIN_TOKENS + 64
    assert [p.tokens >= MIN_TOKENS for p in stored_prefixes(home / "prefixes")] == [True]
    with serving(QWEN3_MOE, home, SECRET, node_id="restart") as node:
        again = _ask(node.rpc.address, "Which tool reads a file?")
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= MIN_TOKENS and again.usage.prompt_tokens - cached < 64


def test_no_prefix_is_kept_on_disk_without_a_budget(pulled_home, hub, tmp_path) -> None:
    home = pulled_home("qwen3_moe", tmp_path / "home")
    with serving(QWEN3_MOE, home, SECRET, node_id="no-disk", prefix_disk_budget="0") as node:
        assert node.service.prefix is not None and node.service.prefix.disk is None  # memory only
