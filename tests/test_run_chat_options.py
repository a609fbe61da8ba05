"""`run` and `chat` as a household member and as a pipe: zeroconf finds the household (like `serve`),
chat's prompts stay off a redirected stdout, `--draft REPO` lands in the expertmesh home, `demo --help`
tells its real defaults, and `pull --core-bits 8` does not pretend to quantise a quantised core."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
from repos import KIMI_K3, MLX_QWEN3_MOE, QWEN3_MOE

from expertmesh.assembly import Node, build_node
from expertmesh.cli import build_parser, main
from expertmesh.cli.generate import node_config
from expertmesh.devtools.local_hub import HubServer
from expertmesh.node.config import HouseholdConfig, NodeConfig, RpcConfig, StoreConfig
from expertmesh.node.errors import SpeculationError
from expertmesh.node.hub import local_models

SECRET = "run-chat-household-secret"
CLUSTER = f"run-chat-{os.getpid()}"  # unique: another test run on this machine shares loopback multicast


def _serving_node(home: Path, cluster: str, secret: str = SECRET) -> Node:
    """A full node as `serve` makes it, advertised on loopback in `cluster`."""
    config = NodeConfig(
        KIMI_K3,
        home=home,
        store=StoreConfig(prefetch=False, fill=False),
        household=HouseholdConfig(secret=secret, discover=True, cluster=cluster, interface="127.0.0.1"),
        rpc=RpcConfig("127.0.0.1", 0),
    )
    return build_node(config).start()


@pytest.fixture
def client_home(pulled_home, hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = pulled_home("kimi_k3", tmp_path / "client")
    monkeypatch.setenv("EXPERTMESH_HOME", str(home))
    monkeypatch.delenv("EXPERTMESH_SECRET", raising=False)
    return home


def _uses(stderr: str, source: str) -> int:
    line = next(ln for ln in stderr.splitlines() if "expert uses by source" in ln)
    m = re.search(rf"\b{source} (\d+)", line.split(":", 1)[1])
    return int(m.group(1)) if m else 0


def test_run_finds_the_household_by_zeroconf_and_uses_it(
    client_home: Path, pulled_home, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("EXPERTMESH_SECRET", SECRET)
    node = _serving_node(pulled_home("kimi_k3", tmp_path / "server"), CLUSTER)
    wrong = _serving_node(pulled_home("kimi_k3", tmp_path / "stranger"), CLUSTER, secret="another-household")
    try:
        where = ["--cluster", CLUSTER, "--interface", "127.0.0.1", "--discovery-wait", "2"]
        args = build_parser().parse_args(["run", KIMI_K3, "x", *where])
        household = node_config(args).household
        assert household is not None and household.peers == [node.rpc.address]
        err = capsys.readouterr().err
        assert f"skipping {wrong.rpc.address}: it refused the household secret" in err and SECRET not in err
        argv = ["run", KIMI_K3, "The household shares", "--max-tokens", "8", "--disk-budget", "0", "--no-prefetch"]
        assert main([*argv, *where]) == 0
        err = capsys.readouterr().err
        assert _uses(err, "peer") > 0, err  # experts came from the node zeroconf found
        args = build_parser().parse_args(["run", KIMI_K3, "x", *where, "--no-discovery"])
        assert node_config(args).household is None
    finally:
        wrong.close()
        node.close()


def test_without_a_household_secret_run_neither_browses_nor_creates_one(client_home: Path) -> None:
    args = build_parser().parse_args(["run", KIMI_K3, "x", "--cluster", CLUSTER, "--discovery-wait", "30"])
    assert node_config(args).household is None  # returns at once: no secret, no household to ask
    assert not (client_home / "secret").exists()


def test_chat_prompts_go_to_stderr_when_stdout_is_not_a_terminal(client_home: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nAnd then?\n"))
    assert main(["chat", KIMI_K3, "--max-tokens", "6", "--no-discovery"]) == 0
    captured = capsys.readouterr()
    assert "> " not in captured.out  # only the replies: `chat > replies.txt` keeps text
    assert captured.err.count("> ") == 3  # two messages, then end of input
    assert captured.err.count("tokens in ") == 2
    assert (local_models.find_pulled(client_home, KIMI_K3) / local_models.LAST_USED_FILENAME).is_file()


def test_a_draft_repo_downloads_into_the_home(client_home: Path, tmp_path: Path, monkeypatch) -> None:
    import huggingface_hub.constants as hf_constants

    from expertmesh.cli import arguments

    hf_cache = tmp_path / "hf-cache"
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hf_cache))
    args = build_parser().parse_args(["run", KIMI_K3, "x", "--speculate", "draft", "--draft", QWEN3_MOE])
    config = arguments.speculation(args)  # downloads only: any repo serves to show where it lands
    path = Path(config.draft_repo)
    assert path.is_relative_to(local_models.drafts_dir(client_home)) and (path / "config.json").is_file()
    assert not hf_cache.exists() or not any(hf_cache.iterdir())
    assert arguments.speculation(args).draft_repo == str(path)  # resolved once: now a folder
    args = build_parser().parse_args(["run", KIMI_K3, "x", "--speculate", "draft", "--draft", "nobody/no-such-draft"])
    with pytest.raises(SpeculationError, match="neither a folder nor a reachable repository") as e:
        arguments.speculation(args)
    assert "was not found at" in str(e.value)  # the hub layer's reason, not an exception's name


def test_a_draft_goes_through_the_hub_layer_pinned_and_reused_offline(client_home: Path, monkeypatch) -> None:
    """Pinned to the commit its revision names, in a folder keyed by that commit; a revision the
    Hub does not have is the hub layer's message; once downloaded it is used without the Hub."""
    import huggingface_hub.constants as hf_constants

    from expertmesh.node.hub import client as hub_client

    commit = hub_client.resolve_commit(QWEN3_MOE)
    path = local_models.fetch_draft(client_home, QWEN3_MOE, "main")
    assert path.name == commit
    with pytest.raises(SpeculationError, match="revision 'no-such-branch' not found"):
        local_models.fetch_draft(client_home, QWEN3_MOE, "no-such-branch")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert local_models.fetch_draft(client_home, QWEN3_MOE) == path
    with pytest.raises(SpeculationError, match="no copy of it was downloaded before"):
        local_models.fetch_draft(client_home, KIMI_K3 + "-not-here")


def test_demo_help_shows_its_real_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in (
        "(default 'Return the number of')",
        "(default 48)",
        "(default 0.5)",
        "(default 0)",
        "(default off)",
    ):
        assert default in text, default
    assert "demo-kimi-k3-draft" in text and "0 is greedy (default)" not in text
    args = build_parser().parse_args(["demo"])
    assert (args.temp, args.seed, args.speculate, args.max_tokens) == (0.5, 0, "off", 48)


def test_core_bits_8_on_a_quantised_core_says_so(hub: HubServer, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path))
    assert main(["pull", MLX_QWEN3_MOE, "--core-bits", "8", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "already quantised" in err and "without --core-bits" in err and "Traceback" not in err
    assert main(["pull", MLX_QWEN3_MOE, "--no-progress"]) == 0
    path = local_models.find_pulled(tmp_path, MLX_QWEN3_MOE)
    before = {p.name: p.stat().st_mtime_ns for p in path.glob("*.safetensors")}
    assert main(["pull", MLX_QWEN3_MOE, "--core-bits", "8", "--no-progress"]) == 1  # over a pull: the same
    assert "already quantised" in capsys.readouterr().err
    assert json.loads((path / local_models.COMPLETE_MARKER).read_text())["core_bits"] == 16  # nothing recorded
    assert {p.name: p.stat().st_mtime_ns for p in path.glob("*.safetensors")} == before  # nothing rewritten
