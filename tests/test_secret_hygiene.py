"""The household secret stays where it is kept: never on a `serve`'s stdout when that is not a
terminal (launchd sends it to a log), never in its log, metrics or zeroconf advertisement, never in
`ps` when given by --secret-file, never in an error message. A wrong secret makes `peers`, `status`
and `warm` fail, saying so; an empty secret file is one line, not a traceback.

Two real `serve` processes on loopback, shared by the module: `created` starts with no secret
anywhere (so it creates one, as a household's first node does) and writes stdout and stderr to one
log file, as the launchd plists do; `from_file` gets its secret by --secret-file.
"""

from __future__ import annotations

import io
import os
import plistlib
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from nodes import serve_command
from repos import KIMI_K3
from waiting import wait_until

from expertmesh.cli import main
from expertmesh.devtools.local_hub import HubServer

CLI = [sys.executable, "-m", "expertmesh"]
CLUSTER = f"secret-hygiene-{os.getpid()}"  # unique: another run's nodes on the loopback stay apart
FILE_SECRET = "file-secret-Zq8TGm4Hc2vXw"  # the --secret-file node's; distinctive, to search for
WRONG = "not-the-household-secret-Pw7Ke"
DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "launchd"


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    home: Path
    log: Path
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _env(home: Path, hub: HubServer) -> dict[str, str]:
    """The environment of a process of these tests: its own home, the test Hub, no inherited secret."""
    env = {**os.environ, "EXPERTMESH_HOME": str(home), "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("EXPERTMESH_SECRET", None)
    env.pop("EXPERTMESH_TLS_CA", None)
    return env


def _start(home: Path, hub: HubServer, *extra: str) -> ServeProcess:
    """`expertmesh -v serve` with stdout and stderr in one file, as launchd runs it (not a terminal)."""
    log = home / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            # -v: INFO logging too, the log as verbose as it gets
            serve_command(KIMI_K3, CLUSTER, "--http-port", "0", "--no-prefetch", *extra, verbose=True),
            env=_env(home, hub),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return ServeProcess(proc, home, log)


def _wait_serving(node: ServeProcess) -> None:
    """Until the node prints its address and its advertisement (at most 120 s)."""
    ready = wait_until(lambda: "advertising" in node.text() or node.proc.poll() is not None, timeout_s=120)
    assert ready and node.proc.poll() is None, node.text()
    node.port = int(re.search(r"on 127\.0\.0\.1:(\d+)", node.text()).group(1))


def _stop(node: ServeProcess) -> None:
    """SIGTERM, a bounded wait, then kill regardless: no process outlives the module."""
    if node.proc.poll() is None:
        node.proc.send_signal(signal.SIGTERM)
        try:
            node.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    node.proc.kill()
    node.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def nodes(hub: HubServer, pulled_home, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServeProcess]]:
    """{"created": a node that made the household secret, "from_file": one given it by --secret-file};
    both start at once (the two load in parallel) and both are stopped at the end."""
    created_home = pulled_home("kimi_k3", tmp_path_factory.mktemp("created"))
    file_home = pulled_home("kimi_k3", tmp_path_factory.mktemp("from-file"))
    secret_file = file_home / "household-secret"
    secret_file.write_text(FILE_SECRET + "\n")
    secret_file.chmod(0o600)
    started = {
        "created": _start(created_home, hub),
        "from_file": _start(file_home, hub, "--cache-only", "--no-http", "--secret-file", str(secret_file)),
    }
    try:
        for node in started.values():
            _wait_serving(node)
        yield started
    finally:
        for node in started.values():
            _stop(node)


def _created_secret(nodes: dict[str, ServeProcess]) -> str:
    return (nodes["created"].home / "secret").read_text().strip()


def _cli(args: list[str], home: Path, hub: HubServer, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args],
        env={**_env(home, hub), **env},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


# -- serve: stdout, log, metrics, advertisement, ps ---------------------------------------------


@pytest.mark.e2e
def test_the_first_serve_keeps_its_new_secret_out_of_a_log(nodes: dict[str, ServeProcess]) -> None:
    node = nodes["created"]
    secret = _created_secret(nodes)
    assert len(secret) >= 24 and (node.home / "secret").stat().st_mode & 0o777 == 0o600
    log = node.text()
    assert secret not in log
    assert "created a household secret" in log and "`expertmesh secret` shows it" in log  # where to get it
    assert "EXPERTMESH_SECRET=" not in log  # no join command, even without the value
    assert "plain TCP" not in log  # on loopback there is no LAN to warn about


@pytest.mark.e2e
def test_expertmesh_secret_prints_it_on_request(nodes: dict[str, ServeProcess], hub: HubServer) -> None:
    r = _cli(["secret"], nodes["created"].home, hub)
    assert r.returncode == 0, r.stderr
    assert r.stdout == _created_secret(nodes) + "\n"  # alone on stdout: `expertmesh secret > FILE` works
    assert "--secret-file" in r.stderr and _created_secret(nodes) not in r.stderr


@pytest.mark.e2e
def test_expertmesh_secret_creates_one_only_when_asked(tmp_path: Path, hub: HubServer) -> None:
    r = _cli(["secret"], tmp_path, hub)
    assert r.returncode != 0 and "--create" in r.stderr and "Traceback" not in r.stderr and r.stdout == ""
    assert not (tmp_path / "secret").exists()
    made = _cli(["secret", "--create"], tmp_path, hub)
    assert made.returncode == 0, made.stderr
    assert made.stdout.strip() == (tmp_path / "secret").read_text().strip() and "just created" in made.stderr
    again = _cli(["secret", "--create"], tmp_path, hub)
    assert again.stdout == made.stdout and "just created" not in again.stderr  # kept, not replaced


@pytest.mark.e2e
def test_metrics_and_the_advertisement_do_not_carry_the_secret(nodes: dict[str, ServeProcess]) -> None:
    from zeroconf import ServiceBrowser, ServiceStateChange, Zeroconf

    from expertmesh.node.household.discovery import SERVICE_TYPE

    secrets = (_created_secret(nodes), FILE_SECRET)
    for node in nodes.values():
        url = re.search(r"metrics on (\S+)", node.text()).group(1)
        with urllib.request.urlopen(url, timeout=30) as r:
            scraped = r.read().decode()
        assert "expertmesh_" in scraped and not any(s in scraped for s in secrets)

    names: set[str] = set()

    def seen(zeroconf, service_type, name, state_change) -> None:
        if state_change is ServiceStateChange.Added:
            names.add(name)

    zc = Zeroconf(interfaces=["127.0.0.1"])
    browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[seen])
    try:
        ours: list[dict] = []

        def both_resolved() -> bool:
            ours.clear()
            for name in list(names):
                info = zc.get_service_info(SERVICE_TYPE, name, timeout=2000)
                if info is not None and info.properties.get(b"cluster") == CLUSTER.encode():
                    ours.append(info.properties)
            return len(ours) == 2

        assert wait_until(both_resolved, timeout_s=30, interval_s=0.5), names
        raw = b"".join(k + (v or b"") for props in ours for k, v in props.items())
        assert not any(s.encode() in raw for s in secrets)
    finally:
        browser.cancel()
        zc.close()


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc/<pid>/cmdline, as `ps` does")
def test_a_secret_file_keeps_the_secret_out_of_ps(nodes: dict[str, ServeProcess]) -> None:
    node = nodes["from_file"]
    cmdline = Path(f"/proc/{node.proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    assert "--secret-file" in cmdline and "serve" in cmdline  # it is that process's command line
    assert FILE_SECRET not in cmdline
    assert FILE_SECRET not in node.text()


# -- the household commands: right secret, wrong secret, no answer ------------------------------


@pytest.mark.e2e
def test_the_right_secret_from_a_file_is_accepted(
    nodes: dict[str, ServeProcess], tmp_path: Path, monkeypatch, capsys
) -> None:
    """The control for the tests below: the same commands do work with the secret."""
    monkeypatch.setenv("EXPERTMESH_HOME", str(nodes["created"].home))
    monkeypatch.delenv("EXPERTMESH_SECRET", raising=False)
    right = tmp_path / "right"
    right.write_text(FILE_SECRET)
    right.chmod(0o600)
    address = nodes["from_file"].address
    assert main(["peers", "--no-discovery", "--peer", address, "--secret-file", str(right)]) == 0
    assert " cache " in capsys.readouterr().out
    assert main(["status", "--no-discovery", "--peer", nodes["created"].address]) == 0  # the home's secret
    assert " full " in capsys.readouterr().out


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["peers", "status", "warm"])
@pytest.mark.parametrize("how", ["--secret-file", "--secret", "EXPERTMESH_SECRET"])
def test_a_wrong_secret_fails_and_says_so_without_printing_a_secret(
    nodes: dict[str, ServeProcess], tmp_path: Path, monkeypatch, capsys, command: str, how: str
) -> None:
    monkeypatch.setenv("EXPERTMESH_HOME", str(nodes["created"].home))  # its right secret is there, unused
    monkeypatch.delenv("EXPERTMESH_SECRET", raising=False)
    args = [command, *([KIMI_K3] if command == "warm" else []), "--no-discovery"]
    args += ["--peer", nodes["created"].address, "--peer", nodes["from_file"].address]
    if how == "--secret-file":
        wrong = tmp_path / "wrong"
        wrong.write_text(WRONG + "\n")
        args += ["--secret-file", str(wrong)]
    elif how == "--secret":
        args += ["--secret", WRONG]
    else:
        monkeypatch.setenv("EXPERTMESH_SECRET", WRONG)
    assert main(args) != 0
    out, err = capsys.readouterr()
    assert "wrong secret" in err and "refused the household secret" in err and "unreachable" not in err
    assert how in err  # says where the refused secret came from
    for secret in (WRONG, FILE_SECRET, _created_secret(nodes)):
        assert secret not in out and secret not in err
    if command == "status":
        assert "no expert has been used yet" not in out


@pytest.mark.e2e
def test_no_answer_is_not_called_a_wrong_secret(nodes: dict[str, ServeProcess], monkeypatch, capsys) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("EXPERTMESH_HOME", str(nodes["created"].home))
    monkeypatch.delenv("EXPERTMESH_SECRET", raising=False)
    for command in (["peers"], ["status"], ["warm", KIMI_K3]):
        assert main([*command, "--no-discovery", "--peer", closed]) != 0
        err = capsys.readouterr().err
        assert "no node answered" in err and "unreachable" in err and "wrong secret" not in err, err


# -- unusable secrets: one line, no traceback -------------------------------------------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [(b"", "is empty"), (b" \n\n", "is empty"), (b"\xff\xfe", "not ASCII"), (None, "cannot read")],
)
def test_an_unusable_secret_file_is_one_clear_line(
    tmp_path: Path, monkeypatch, capsys, content: bytes | None, expected: str
) -> None:
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path))
    monkeypatch.delenv("EXPERTMESH_SECRET", raising=False)
    path = tmp_path / "secret-file"
    if content is not None:
        path.write_bytes(content)
    for command in (["peers"], ["status"], ["warm", KIMI_K3]):
        assert main([*command, "--no-discovery", "--peer", "127.0.0.1:1", "--secret-file", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and expected in err and str(path) in err


@pytest.mark.e2e
def test_an_empty_secret_file_stops_serve_and_run_before_loading(tmp_path: Path, hub: HubServer) -> None:
    """As processes: the exit code and stderr a user (or launchd) sees, and nothing created."""
    empty = tmp_path / "empty"
    empty.write_text("")
    for command in (
        ["serve", KIMI_K3, "--port", "0", "--no-discovery", "--no-http", "--no-metrics"],
        ["run", KIMI_K3, "hi", "--peer", "127.0.0.1:1"],
    ):
        r = _cli([*command, "--secret-file", str(empty)], tmp_path, hub)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr == f"error: the secret file {empty} is empty: copy the household secret into it " + (
            "(`expertmesh secret` on a node shows it)\n"
        )
    (tmp_path / "secret").write_text("\n")  # the home's own file, emptied: an error, not replaced
    r = _cli(["serve", KIMI_K3, "--port", "0", "--no-discovery", "--no-http", "--no-metrics"], tmp_path, hub)
    assert r.returncode == 1 and "is empty" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "secret").read_text() == "\n"


def test_a_secret_gRPC_cannot_carry_is_refused_by_name_not_value(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path))
    monkeypatch.setenv("EXPERTMESH_SECRET", "caf\u00e9-secret")
    assert main(["peers", "--no-discovery", "--peer", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert "EXPERTMESH_SECRET" in err and "printable ASCII" in err and "caf" not in err


def test_a_secret_file_others_can_read_is_warned_about(tmp_path: Path, monkeypatch, capsys) -> None:
    import argparse

    from expertmesh.cli import arguments

    path = tmp_path / "shared"
    path.write_text("loose-secret\n")
    path.chmod(0o644)
    monkeypatch.delenv("EXPERTMESH_SECRET", raising=False)
    assert arguments.known_secret(argparse.Namespace(secret=None, secret_file=str(path)))[0] == "loose-secret"
    err = capsys.readouterr().err
    assert f"chmod 600 {path}" in err and "loose-secret" not in err


# -- the join command, TLS warning and launchd ---------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_join_command_goes_to_a_terminal_only(tmp_path: Path, monkeypatch) -> None:
    from expertmesh.cli import serve

    monkeypatch.setenv("EXPERTMESH_HOME", str(tmp_path))
    for out, shown in ((_Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stdout", out)
        serve._tell_how_to_join("s3cr3t-value", KIMI_K3)
        assert ("EXPERTMESH_SECRET=s3cr3t-value expertmesh serve" in out.getvalue()) is shown
        assert shown or "`expertmesh secret`" in out.getvalue()


def test_only_loopback_serving_skips_the_plain_tcp_warning() -> None:
    from expertmesh.cli.serve import _loopback

    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost")
    assert not _loopback("0.0.0.0") and not _loopback("192.168.1.20") and not _loopback("mac.local")


def test_launchd_logs_under_the_users_library_and_plists_hold_no_secret() -> None:
    plists = sorted(DEPLOY.glob("*.plist"))
    assert len(plists) == 2
    for path in plists:
        doc = plistlib.loads(path.read_bytes())
        for key in ("StandardOutPath", "StandardErrorPath"):
            assert doc[key].startswith("/Users/YOU/Library/Logs/expertmesh/"), (path, doc[key])
        assert "--secret" not in doc["ProgramArguments"]
        assert "EXPERTMESH_SECRET" not in doc.get("EnvironmentVariables", {})
