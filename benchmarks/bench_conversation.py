"""Conversations with the prefix cache on and off, side by side in one run (issue 45): the same
chat and the same agent loop through the official `openai` client against a node's API, once on
a node with `--prefix-cache` and once on one with `--prefix-cache 0`, the two taken turn by turn
so the machine's load falls on both alike.

    chat    a system prompt, then `--turns` user turns, each answered (greedy, `--reply` tokens)
    agent   a long system prompt (about `--system` tokens), then `--steps` tool results of 50-200
            tokens, each answered

Per turn and configuration: the prompt's tokens, the tokens fed to the model (prompt minus what
the API reports as `cached_tokens`), the expert bytes it fetched (disk, peers, Hub) and used (every
tier, RAM included, counted per forward pass), and the time to the first streamed token. `tokens_equal`: both configurations replied the same on every turn.

    python benchmarks/bench_conversation.py [--arch kimi_k3] [--turns 6] [--steps 12] [--system 1500]
        [--reply 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

SCENARIOS = ("chat", "agent")
QUESTIONS = (
    "Name three colours.",
    "And three animals?",
    "Which of them is fastest?",
    "Why is that?",
    "Say it in one line.",
    "Thank you. Anything else?",
)


def _words(rng: random.Random, n: int, per_word: float = 1.0) -> str:
    """About `n` tokens of text (`per_word`: the tokenizer's tokens a word)."""
    vocabulary = ("the", "tool", "returned", "rows", "for", "query", "value", "of", "field", "error", "ok", "list")
    return " ".join(rng.choice(vocabulary) for _ in range(max(1, round(n / per_word))))


def _conversations(
    turns: int, steps: int, system: int, per_word: float
) -> tuple[list[list[dict]], dict[str, list[list[dict]]]]:
    """Each scenario's first messages, and the messages each turn adds (the replies come between)."""
    rng = random.Random(0)
    chat = [{"role": "system", "content": "You answer briefly."}]
    agent = [{"role": "system", "content": "You are an agent with tools. " + _words(rng, system, per_word)}]
    return [chat, agent], {
        "chat": [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(turns)],
        "agent": [
            [{"role": "user", "content": "Tool result: " + _words(rng, rng.randrange(50, 200), per_word)}]
            for _ in range(steps)
        ],
    }


def _node(repo_id: str, home: Path, prefix_cache: str):
    from expertmesh.assembly import build_node
    from expertmesh.node.config import ApiConfig, HouseholdConfig, NodeConfig, RpcConfig, StoreConfig

    config = NodeConfig(
        repo_id,
        home=home,
        node_id=f"bench-conversation-{prefix_cache}",
        store=StoreConfig(prefetch=False),
        household=HouseholdConfig(secret="bench-conversation"),
        rpc=RpcConfig(host="127.0.0.1", port=0),
        api=ApiConfig(host="127.0.0.1", port=0),
        prefix_cache=prefix_cache,
    )
    return build_node(config).start()


def _turn(client, node, repo_id: str, messages: list[dict], reply: int) -> tuple[str, dict]:
    stats = node.model.store.stats
    before = stats.snapshot()
    t0 = time.perf_counter()
    ttft = None
    text, usage = [], None
    stream = client.chat.completions.create(
        model=repo_id,
        messages=messages,
        max_tokens=reply,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    spent = stats.since(before)
    fetched = sum(n for source, n in spent.bytes.items() if source != "ram")
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return "".join(text), {
        "prompt_tokens": usage.prompt_tokens,
        "fed_tokens": usage.prompt_tokens - cached,
        "expert_bytes": fetched,  # read from the disk, peers or the Hub
        "expert_use_bytes": sum(spent.bytes.values()),  # every tier's, RAM included (per pass)
        "ttft_s": round(ttft if ttft is not None else time.perf_counter() - t0, 4),
    }


def run(arch: str, turns: int, steps: int, system: int, reply: int) -> dict:
    import openai

    from expertmesh.devtools.local_hub import HubServer
    from expertmesh.devtools.tiny import make_tiny_model
    from expertmesh.node.hub import client as hub_client
    from expertmesh.node.hub.pull import pull

    out: dict = {"arch": arch, "reply_tokens": reply, "turns": []}
    equal = True
    with tempfile.TemporaryDirectory(prefix="expertmesh-bench-conversation-") as tmp:
        repo_id = f"bench/tiny-{arch}"
        repo = make_tiny_model(Path(tmp) / "hub" / repo_id, arch, seed=0)
        from transformers import AutoTokenizer

        sample = _words(random.Random(1), 200)
        per_word = len(AutoTokenizer.from_pretrained(repo).encode(sample)) / 200
        heads, requests = _conversations(turns, steps, system, per_word)
        with HubServer(Path(tmp) / "hub") as hub, hub_client.using_endpoint(hub.url):
            homes = {c: Path(tmp) / f"home-{c}" for c in ("on", "off")}
            for home in homes.values():
                pull(repo_id, home=home, progress=False)
            nodes = {"on": _node(repo_id, homes["on"], "1GB"), "off": _node(repo_id, homes["off"], "0")}
            try:
                clients = {
                    c: openai.OpenAI(base_url=f"http://127.0.0.1:{n.api.port}/v1", api_key="-", max_retries=0)
                    for c, n in nodes.items()
                }
                for scenario, head in zip(SCENARIOS, heads):
                    history = {c: list(head) for c in nodes}
                    for i, new in enumerate(requests[scenario]):
                        texts = {}
                        for c in ("on", "off"):
                            history[c] += new
                            texts[c], row = _turn(clients[c], nodes[c], repo_id, history[c], reply)
                            history[c].append({"role": "assistant", "content": texts[c]})
                            out["turns"].append({"scenario": scenario, "turn": i + 1, "cache": c, **row})
                            print(json.dumps(out["turns"][-1]), flush=True)
                        equal &= texts["on"] == texts["off"]
            finally:
                for n in nodes.values():
                    n.close()
    out["tokens_equal"] = equal
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="kimi_k3")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--system", type=int, default=1500, help="the agent's system prompt, in tokens (about)")
    parser.add_argument("--reply", type=int, default=12)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    doc = run(args.arch, args.turns, args.steps, args.system, args.reply)
    by = {(t["scenario"], t["turn"], t["cache"]): t for t in doc["turns"]}
    print(f"{'scenario':8} {'turn':>4} {'prompt':>7} {'fed on':>7} {'fed off':>7} {'ttft on/off':>11}")
    for (scenario, turn, cache), t in by.items():
        if cache != "on":
            continue
        off = by[scenario, turn, "off"]
        ratio = t["ttft_s"] / off["ttft_s"] if off["ttft_s"] else 0.0
        print(
            f"{scenario:8} {turn:>4} {t['prompt_tokens']:>7} {t['fed_tokens']:>7} {off['fed_tokens']:>7} {ratio:>11.2f}"
        )
    print(f"tokens equal: {doc['tokens_equal']}")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
