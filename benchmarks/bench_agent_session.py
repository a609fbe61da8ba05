"""A recorded agent session replayed through the official `anthropic` client, with Claude Code's
billing line handled and passed through, side by side in one run (issue 47): what share of each
request's prompt the node's prefix cache holds.

Claude Code opens its `system` with `x-anthropic-billing-header: cc_version=...; cch=...;`, whose
values change on every request. The Messages API drops that line (coordinator/anthropic_request.py);
`passed` is the same translation with the line kept (the module's pattern swapped for one that
matches nothing, for that configuration's requests only), as a server without the fix would do.

The session is recorded in shape: a long system prompt (about `--system` tokens) after the billing
line, four tools, a first user turn, then `--steps` steps of an assistant's text and `tool_use`
and the user's `tool_result` (40-120 tokens each). Request i sends the session up to step i, as an
agent resends its whole history; the assistant turns are the recording's, so the model's own
replies (`--reply` tokens, discarded) do not change the prompts. Each configuration has its own
node (`--prefix-cache` 1GB), both serving the tiny `json_tools` family (its template renders the
tools, calls and results), taken request by request so the machine's load falls on both alike.

Per request and configuration: the prompt's tokens (`input_tokens + cache_read_input_tokens`),
those read from the prefix cache, their share, and the request's time; then the aggregate share
(all cached tokens over all prompt tokens) and the same without the first request (nothing to
reuse yet).

    python benchmarks/bench_agent_session.py [--family json_tools] [--steps 10] [--system 500]
        [--reply 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path

CONFIGS = ("handled", "passed")
TOOLS = [
    {"name": name, "description": description, "input_schema": {"type": "object", "properties": properties,
                                                                "required": list(properties)}}
    for name, description, properties in (
        ("Read", "Read a file from the working tree.", {"file_path": {"type": "string"}}),
        ("Bash", "Run a shell command.", {"command": {"type": "string"}, "timeout": {"type": "integer"}}),
        ("Edit", "Replace a string in a file.", {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                                                 "new_string": {"type": "string"}}),
        ("Grep", "Search files for a pattern.", {"pattern": {"type": "string"}, "path": {"type": "string"}}),
    )
]  # fmt: skip
VOCABULARY = ("the", "test", "file", "returned", "line", "for", "error", "value", "of", "def", "ok", "import")


def _words(rng: random.Random, n: int, per_word: float) -> str:
    """About `n` tokens of text (`per_word`: the tokenizer's tokens a word)."""
    return " ".join(rng.choice(VOCABULARY) for _ in range(max(1, round(n / per_word))))


def billing_line(rng: random.Random) -> str:
    """A billing line as Claude Code writes it, its version suffix and `cch=` new each request."""
    return f"x-anthropic-billing-header: cc_version=2.0.14.{rng.randbytes(2).hex()[:3]}; cc_entrypoint=cli; cch={rng.randbytes(3).hex()[:5]};"


def session(steps: int, system: int, per_word: float) -> tuple[str, list[dict]]:
    """The system prompt (without its billing line) and the messages of the whole session."""
    rng = random.Random(0)
    prompt = "You are an interactive coding agent. Use the tools to help the user. " + _words(rng, system, per_word)
    messages: list[dict] = [
        {"role": "user", "content": "The tests fail after the last change; find out why and fix it."}
    ]
    for step in range(steps):
        tool = TOOLS[step % len(TOOLS)]
        arguments = {key: f"{key}-{step}" if spec["type"] == "string" else 30 for key, spec in tool["input_schema"]["properties"].items()}  # fmt: skip
        call = {"type": "tool_use", "id": f"toolu_{step:04d}", "name": tool["name"], "input": arguments}
        text = {"type": "text", "text": f"Step {step + 1}: " + _words(rng, rng.randrange(10, 30), per_word)}
        messages.append({"role": "assistant", "content": [text, call]})
        result = _words(rng, rng.randrange(40, 120), per_word)
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": result}]})  # fmt: skip
    return prompt, messages


def _node(repo_id: str, home: Path, name: str):
    from expertmesh.assembly import build_node
    from expertmesh.node.config import ApiConfig, HouseholdConfig, NodeConfig, RpcConfig, StoreConfig

    config = NodeConfig(
        repo_id,
        home=home,
        node_id=f"bench-agent-session-{name}",
        store=StoreConfig(prefetch=False),
        household=HouseholdConfig(secret="bench-agent-session"),
        rpc=RpcConfig(host="127.0.0.1", port=0),
        api=ApiConfig(host="127.0.0.1", port=0),
        prefix_cache="1GB",
    )
    return build_node(config).start()


def _request(client, repo_id: str, system: list[dict], messages: list[dict], reply: int, keep: bool) -> dict:
    """One request; `keep`: the translation passes the billing line through (the `passed` configuration)."""
    from expertmesh.coordinator import anthropic_request

    handled = anthropic_request.BILLING_LINE
    if keep:  # requests run one at a time, so swapping the pattern touches this request only
        anthropic_request.BILLING_LINE = re.compile(r"(?!)")
    try:
        t0 = time.perf_counter()
        m = client.messages.create(
            model=repo_id,
            max_tokens=reply,
            system=system,
            tools=TOOLS,
            messages=messages,
            extra_body={"temperature": 0},
        )
        seconds = time.perf_counter() - t0
    finally:
        anthropic_request.BILLING_LINE = handled
    cached = m.usage.cache_read_input_tokens or 0
    prompt = m.usage.input_tokens + cached
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit": round(cached / prompt, 4), "s": round(seconds, 3)}


def run(family: str, steps: int, system: int, reply: int) -> dict:
    import anthropic
    from transformers import AutoTokenizer

    from expertmesh.devtools.local_hub import HubServer
    from expertmesh.devtools.tiny import make_tiny_model
    from expertmesh.devtools.tiny.tool_formats import FORMATS, make_tool_repo
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    out: dict = {"family": family, "steps": steps, "requests": []}
    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-agent-session-") as tmp:
        hub_root = Path(tmp) / "hub"
        base = make_tiny_model(hub_root / "bench" / f"tiny-{FORMATS[family].base}", FORMATS[family].base, seed=0)
        repo_id = f"bench/tiny-{family}"
        repo = make_tool_repo(hub_root / repo_id, family, base)
        per_word = len(AutoTokenizer.from_pretrained(repo).encode(_words(random.Random(1), 200, 1.0))) / 200
        prompt, messages = session(steps, system, per_word)
        rng = random.Random(2)
        with HubServer(hub_root) as hub, hub_client.using_endpoint(hub.url):
            homes = {c: Path(tmp) / f"home-{c}" for c in CONFIGS}
            for home in homes.values():
                pull(repo_id, home=home, progress=False)
            nodes = {c: _node(repo_id, homes[c], c) for c in CONFIGS}
            try:
                clients = {
                    c: anthropic.Anthropic(base_url=f"http://127.0.0.1:{n.api.port}", api_key="-", max_retries=0,
                                           timeout=600)
                    for c, n in nodes.items()
                }  # fmt: skip
                for i in range(steps + 1):
                    # the same billing line for both configurations: only its handling differs
                    system_blocks = [{"type": "text", "text": billing_line(rng)}, {"type": "text", "text": prompt}]
                    history = messages[: 1 + 2 * i]
                    for c in CONFIGS:
                        row = _request(clients[c], repo_id, system_blocks, history, reply, keep=c == "passed")
                        out["requests"].append({"request": i + 1, "billing": c, **row})
                        print(json.dumps(out["requests"][-1]), flush=True)
            finally:
                for n in nodes.values():
                    n.close()
    for c in CONFIGS:
        rows = [r for r in out["requests"] if r["billing"] == c]
        out[c] = {
            "hit_rate": sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows),
            "hit_rate_after_first": sum(r["cached_tokens"] for r in rows[1:]) / sum(r["prompt_tokens"] for r in rows[1:]),
            "seconds": sum(r["s"] for r in rows),
        }  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="json_tools", help="a tool-format family of the tiny repos")
    parser.add_argument("--steps", type=int, default=10, help="tool_use/tool_result steps after the first request")
    parser.add_argument("--system", type=int, default=500, help="the system prompt, in tokens (about)")
    parser.add_argument("--reply", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    doc = run(args.family, args.steps, args.system, args.reply)
    by = {(r["request"], r["billing"]): r for r in doc["requests"]}
    print(
        f"{'request':>7} {'prompt':>7} {'cached handled':>14} {'cached passed':>13} {'hit handled':>11} {'hit passed':>10}"
    )
    for i in range(1, args.steps + 2):
        h, p = by[i, "handled"], by[i, "passed"]
        print(f"{i:>7} {h['prompt_tokens']:>7} {h['cached_tokens']:>14} {p['cached_tokens']:>13} {h['hit']:>11.1%} {p['hit']:>10.1%}")  # fmt: skip
    for c in CONFIGS:
        s = doc[c]
        print(f"{c:8} hit rate {s['hit_rate']:.1%} (after the first request {s['hit_rate_after_first']:.1%}), {s['seconds']:.1f} s in all")  # fmt: skip
    print(f"time passed / handled: {doc['passed']['seconds'] / doc['handled']['seconds']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
