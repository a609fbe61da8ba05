"""`expertmesh run`, `chat` and `demo` as a user runs them: real processes against a real local Hub."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from repos import KIMI_K3

from expertmesh.devtools.local_hub import HubServer

CLI = [sys.executable, "-m", "expertmesh"]


def _env(home: Path, hub: HubServer | None = None) -> dict[str, str]:
    env = {**os.environ, "EXPERTMESH_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    if hub is not None:
        env["HF_ENDPOINT"] = hub.url
    return env


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=300)


def _uses(stderr: str, source: str) -> int:
    """Expert uses of `source` from the summary line `expert uses by source: ram 3 (..), hub 2 (..)`."""
    line = next(ln for ln in stderr.splitlines() if "expert uses by source" in ln)
    for part in line.split(":", 1)[1].split(","):
        words = part.split()
        if words and words[0] == source:
            return int(words[1])
    return 0


@pytest.mark.e2e
def test_run_streams_mlx_lm_text_and_a_summary(hub: HubServer, module_home: Path, oracle) -> None:

    prompt = "The cat sat on"
    r = _run(["run", KIMI_K3, prompt, "--max-tokens", "16"], _env(module_home, hub))
    assert r.returncode == 0, r.stderr
    expected = oracle.text("kimi_k3", prompt, 16)
    assert r.stdout == expected + "\n"  # stdout holds the generated text and nothing else
    assert "16 tokens in" in r.stderr and "tokens/s" in r.stderr and "time to first token" in r.stderr
    assert _uses(r.stderr, "hub") + _uses(r.stderr, "disk") > 0


@pytest.mark.e2e
def test_run_with_a_seed_is_reproducible(hub: HubServer, module_home: Path) -> None:
    args = ["run", KIMI_K3, "Once", "--max-tokens", "24", "--temp", "1.0", "--top-p", "0.95"]
    a = _run([*args, "--seed", "3"], _env(module_home, hub))
    b = _run([*args, "--seed", "3"], _env(module_home, hub))
    c = _run([*args, "--seed", "4"], _env(module_home, hub))
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr + c.stderr
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout  # 24 tokens sampled from a random tiny model: a collision is implausible


@pytest.mark.e2e
def test_run_on_a_model_not_pulled_says_how_to_pull_it(tmp_path: Path) -> None:
    r = _run(["run", "someone/not-here", "hi"], _env(tmp_path))
    assert r.returncode != 0
    assert "expertmesh pull someone/not-here" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.e2e
def test_run_rejects_a_bad_budget(module_home: Path) -> None:
    r = _run(["run", KIMI_K3, "hi", "--ram-budget", "lots"], _env(module_home))
    assert r.returncode == 2 and "--ram-budget" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.e2e
def test_chat_takes_turns_until_end_of_input(hub: HubServer, module_home: Path) -> None:
    r = subprocess.run(
        [*CLI, "chat", KIMI_K3, "--max-tokens", "8"],
        env=_env(module_home, hub),
        input="Hi\nAnd then?\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("tokens in ") == 2  # one summary per reply


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(hub: HubServer, module_home: Path) -> None:
    """A real SIGINT in the middle of a real reply: the reply stops, the next turn continues the cache."""
    from expertmesh.assembly import open_model
    from expertmesh.cli.terminal import chat_loop
    from expertmesh.node.engine.chat import ChatSession
    from expertmesh.node.engine.generation import Generator, SamplingSettings

    sm = open_model(KIMI_K3, home=module_home)
    try:
        session = ChatSession(Generator(sm))
        summaries = []

        def reply(text, stop, summary):
            summaries.append(summary)
            for n, tok in enumerate(session.reply(text, SamplingSettings(max_tokens=100), stop, summary)):
                if n == 2 and len(summaries) == 1:
                    os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C in the terminal sends
                yield tok

        lines = ["Tell me a story", "And then?"]

        def read_line(_prompt: str) -> str:
            if not lines:
                raise EOFError  # what Ctrl-D at the prompt gives
            return lines.pop(0)

        turns = chat_loop(reply, read_line=read_line, show_summary=False)
    finally:
        sm.close()
    assert turns == 2
    assert summaries[0].stop_reason == "interrupted" and summaries[0].generated_tokens == 3
    assert summaries[1].generated_tokens > 0 and session.rebuilds == 0  # the same cache went on
    assert len(session.messages) == 4  # both turns kept, the stopped reply as far as it got


def _generated(stdout: str) -> str:
    """The generated text: between the demo's `prompt:` line and its closing Hub line."""
    after = stdout.split("prompt:", 1)[1].split("\n", 1)[1]
    return after.rsplit("   the Hub served", 1)[0].strip()


@pytest.mark.e2e
def test_demo_generates_then_serves_experts_from_its_caches(tmp_path: Path) -> None:
    first = _run(["demo", "--no-progress", "--max-tokens", "12"], _env(tmp_path))
    assert first.returncode == 0, first.stderr
    assert "pulled expertmesh/demo-kimi-k3" in first.stdout and " tokens in " in first.stderr
    assert _uses(first.stderr, "hub") > 0
    second = _run(["demo", "--no-progress", "--max-tokens", "12"], _env(tmp_path))
    assert second.returncode == 0, second.stderr
    assert "already pulled" in second.stdout
    assert _uses(second.stderr, "hub") == 0 and _uses(second.stderr, "disk") > 0
    assert _generated(first.stdout) and _generated(first.stdout) == _generated(second.stdout)


@pytest.mark.e2e
def test_a_trace_of_a_run_replays_through_every_policy(hub: HubServer, module_home: Path, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    r = _run(
        ["run", KIMI_K3, "A trace of the routing", "--max-tokens", "10", "--trace", str(trace)], _env(module_home, hub)
    )
    assert r.returncode == 0, r.stderr
    out = _run(["replay", str(trace), "--budgets", "25%,40"], _env(module_home))
    assert out.returncode == 0, out.stderr
    # the prompt with its last token in one pass a layer (layer-major prefill, node/engine/prefill.py),
    # then a single-token pass for each of the 9 tokens after the first (the last is not fed)
    assert "10 passes" in out.stdout
    rows = {ln.split()[0]: [float(x) for x in ln.split()[1:]] for ln in out.stdout.splitlines()[2:]}
    assert set(rows) == {"lru", "lfu", "arc", "freq_oracle", "belady"}
    assert all(0 <= v <= rows["belady"][i] + 1e-9 for name, vals in rows.items() for i, v in enumerate(vals))
    assert _run(["replay", str(tmp_path / "missing.jsonl")], _env(module_home)).stderr.startswith("error:")


@pytest.mark.e2e
def test_local_problems_are_one_line_without_a_traceback(module_home: Path, tmp_path: Path) -> None:
    """Found by an audit of the CLI: each of these ended in a Python traceback."""
    env = _env(module_home)
    empty = _run(["run", KIMI_K3, "", "--no-discovery"], env)
    assert empty.returncode == 1 and "nothing to generate" in empty.stderr and "Traceback" not in empty.stderr
    into_a_folder = _run(["run", KIMI_K3, "hi", "--trace", str(tmp_path), "--no-discovery"], env)
    assert into_a_folder.returncode != 0 and "Traceback" not in into_a_folder.stderr
    assert "cannot write the routing trace" in into_a_folder.stderr


@pytest.mark.e2e
def test_text_that_is_not_utf8_and_a_closed_stdin_are_input_not_crashes(hub: HubServer, module_home: Path) -> None:
    """Python keeps bytes that are not UTF-8 as lone surrogates, which the tokenizer refused with a
    TypeError; a chat started with stdin closed (`0<&-`) read from None."""
    env = _env(module_home, hub)
    prompt = subprocess.run(
        [*CLI, "run", KIMI_K3, os.fsdecode(b"caf\xff"), "--max-tokens", "2", "--no-discovery"],
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert prompt.returncode == 0 and b"Traceback" not in prompt.stderr, prompt.stderr[-500:]
    piped = subprocess.run(
        [*CLI, "chat", KIMI_K3, "--max-tokens", "2", "--no-discovery"],
        env=env,
        input=b"\xff\xfe caf\xe9\n",
        capture_output=True,
        timeout=300,
    )
    assert piped.returncode == 0 and b"Traceback" not in piped.stderr, piped.stderr[-500:]
    closed = subprocess.run(
        [*CLI, "chat", KIMI_K3, "--no-discovery"], env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=300
    )
    assert closed.returncode == 0 and b"Traceback" not in closed.stderr


@pytest.mark.e2e
def test_a_reader_that_leaves_ends_run_quietly(hub: HubServer, module_home: Path) -> None:
    """`run ... | head -c 1`: two tracebacks and an 'MLX thread has stopped' before; now a quiet
    exit with the status a shell gives a command killed by SIGPIPE."""
    proc = subprocess.Popen(
        [*CLI, "run", KIMI_K3, "def f():", "--max-tokens", "200", "--no-discovery", "--speculate", "off"],
        env=_env(module_home, hub),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        proc.stdout.read(1)
        proc.stdout.close()  # the reader leaves after one byte
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 141 and b"Traceback" not in err, err[-800:]
