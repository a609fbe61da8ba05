"""Bad command-line values fail in one line before anything loads, binds or is fetched.

An audit of the CLI found a traceback (or worse, a silent misbehaviour) for each of these: a port
of 70000 that gRPC took modulo 65536, `--max-tokens -1` generating without a bound, a NaN
temperature, a 400-digit budget overflowing, a pasted URL or `../x` as a repo id. argparse answers
them with its usage line and exit status 2; nothing here needs a model or a network."""

from __future__ import annotations

import pytest

from expertmesh.cli import main
from expertmesh.cli.arguments import repo_id
from expertmesh.node.sizes import parse_size

HUGE = "9" * 400


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["serve", "a/b", "--port", "70000"], "--port"),
        (["serve", "a/b", "--port", "-1"], "--port"),
        (["serve", "a/b", "--http-port", "65536"], "--http-port"),
        (["run", "a/b", "hi", "--metrics-port", "70000"], "--metrics-port"),
        (["doctor", "--port", "99999"], "--port"),
        (["hub", ".", "--port", "70000"], "--port"),
        (["run", "a/b", "hi", "--max-tokens", "0"], "--max-tokens"),
        (["run", "a/b", "hi", "--max-tokens", "-1"], "--max-tokens"),
        (["run", "a/b", "hi", "--temp", "nan"], "--temp"),
        (["run", "a/b", "hi", "--temp", "inf"], "--temp"),
        (["run", "a/b", "hi", "--temp", "-1"], "--temp"),
        (["run", "a/b", "hi", "--top-p", "2"], "--top-p"),
        (["run", "a/b", "hi", "--top-p", "nan"], "--top-p"),
        (["run", "a/b", "hi", "--seed", str(2**64)], "--seed"),
        (["run", "a/b", "hi", "--ram-budget", HUGE], "--ram-budget"),
        (["run", "a/b", "hi", "--discovery-wait", "nan"], "--discovery-wait"),
        (["pull", "a/b", "--concurrency", "0"], "--concurrency"),
        (["pull", "../x"], "repo"),
        (["pull", "a/../../b"], "repo"),
        (["pull", "a b/c"], "repo"),
        (["pull", ""], "repo"),
        (["run", "../..", "hi"], "repo"),
        (["rm", "a/b/c"], "repo"),
        (["cache", "/etc/passwd"], "repo"),
        (["peers", "--no-discovery", "--peer", "127.0.0.1"], "--peer"),  # was "wrong secret"
        (["status", "--peer", "127.0.0.1:99999"], "--peer"),
        (["run", "a/b", "hi", "--peer", "::::"], "--peer"),
        (["run", "a/b", "hi", "--max-context", "0"], "--max-context"),
        (["serve", "a/b", "--core-budget", "half"], "--core-budget"),
        (["chat", "a/b", "--core-budget", "120%"], "--core-budget"),
        (["doctor", "--plan", "k3", "--memory", "lots"], "--memory"),
        (["doctor", "--plan", "k3", "--core-bits", "3"], "--core-bits"),
        (["pull", "a/b", "--core-bits", "6"], "--core-bits"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_flag(argv: list[str], flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err, err


def test_a_pasted_hub_url_is_its_repo_id() -> None:
    assert repo_id("https://huggingface.co/moonshotai/Kimi-K3/tree/main") == "moonshotai/Kimi-K3"
    assert repo_id("moonshotai/Kimi-K3") == "moonshotai/Kimi-K3"


def test_a_size_beyond_any_disk_is_a_value_error_not_an_overflow() -> None:
    with pytest.raises(ValueError, match="larger than any disk"):
        parse_size(HUGE + "TB")
    assert parse_size("1.5GiB") == 3 * 2**29


def test_a_prune_target_beyond_any_disk_is_one_line(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path))
    assert main(["cache", "--prune", HUGE]) != 0
    err = capsys.readouterr().err
    assert "larger than any disk" in err and "Traceback" not in err


def test_a_hub_over_a_folder_that_is_not_there_is_refused(tmp_path, capsys) -> None:
    """It served an empty Hub, and every pull then said "no such model repository"."""
    assert main(["hub", str(tmp_path / "no-such-folder")]) != 0
    assert "is not a folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["bench", "--compute", "--shapes", "k3_depth,nope"], "--shapes"),
        (["bench", "--model", "k3-proportions", "--configs", ","], "--configs"),
        (["lab", "--scenarios", "remote,elsewhere"], "--scenarios"),
    ],
)
def test_a_list_of_names_with_an_unknown_one_is_refused_before_anything_runs(argv, flag, capsys) -> None:
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {flag}: unknown") and "choose from" in err and "\n" not in err
