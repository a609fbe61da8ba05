"""Keeps the `e2e` marker true: a test is marked e2e exactly when it starts a process (the
`expertmesh` command, `serve`, a Prometheus, `ip netns`, any command), so under `-m "not e2e"` the
tests start none (pytest-xdist's workers are pytest's, not a test's).

Every way the standard library starts a process ends in `_posixsubprocess.fork_exec` (subprocess,
asyncio, multiprocessing's spawn), `os.fork`, `os.forkpty`, `os.system` or `os.posix_spawn[p]`.
Each is wrapped for the whole session, at run time rather than by reading the tests' source, so a
process started through a helper, a fixture or a thread counts as much as one in the test's body;
the session refuses to start if a probe process goes unseen. A test that starts a process and is
not marked, or is marked and starts none, fails at its teardown with the command and the line that
started it. A module- or session-scoped fixture that starts a process counts for every test that
uses it, whichever test set it up, so the verdict does not depend on the order tests run in.

A process a library starts on its own behalf (the first caller outside the standard library lies in
site-packages: ifaddr runs `ldconfig -p` to find libc) is not the test's doing; `-v` lists them.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
import sys
import sysconfig
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

MARKER = "e2e"
SHOWN = 5  # processes named in a failure
REPO = Path(__file__).resolve().parent.parent
_STDLIB = tuple(
    str(Path(sysconfig.get_paths()[key]).resolve()) + os.sep
    for key in ("stdlib", "platstdlib")
    if key in sysconfig.get_paths()
)
_SITE = tuple(str(Path(p).resolve()) + os.sep for p in sys.path if p.endswith("-packages"))


class _Watch:
    """Who is running now (the test, and the fixtures being set up) and what each started."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.fixtures: list[pytest.FixtureDef] = []
        self.by_item: dict[str, list[str]] = {}
        self.by_fixture: dict[int, list[str]] = {}  # id(FixtureDef): fixtures live for the session
        self.by_library: Counter[str] = Counter()
        self.probe: list[str] | None = None  # set while checking that the wrappers see a process
        self.outside_tests: list[str] = []  # at collection, or in a hook: failed with the next test

    def started(self, what: str) -> None:
        if self.probe is not None:
            self.probe.append(what)
            return
        caller = _first_caller_outside_stdlib()
        if caller is None or _library(caller.filename):
            self.by_library[f"{what} from {_where(caller)}"] += 1
            return
        line = f"{what} at {_where(caller)}"
        if self.fixtures and self.fixtures[-1].scope != "function":  # it counts for every test using it
            self.by_fixture.setdefault(id(self.fixtures[-1]), []).append(line)
        elif self.item is not None:
            self.by_item.setdefault(self.item.nodeid, []).append(line)
        else:
            self.outside_tests.append(line)

    def for_item(self, item: pytest.Item) -> list[str]:
        """What `item` started itself or through any fixture it uses."""
        lines = list(self.by_item.get(item.nodeid, []))
        for defs in item._fixtureinfo.name2fixturedefs.values():  # the last definition is the one in use
            lines += [f"{line} (fixture {defs[-1].argname})" for line in self.by_fixture.get(id(defs[-1]), [])]
        return lines


def _first_caller_outside_stdlib() -> traceback.FrameSummary | None:
    here = str(Path(__file__).resolve())
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith("<"):  # frozen: the standard library's
            continue
        name = str(Path(frame.filename).resolve())
        if name != here and not (name.startswith(_STDLIB) and not name.startswith(_SITE)):
            return frame
    return None


def _library(filename: str) -> bool:
    """An installed library's file, not this project's tests or package."""
    return str(Path(filename).resolve()).startswith(_SITE)


def _where(frame: traceback.FrameSummary | None) -> str:
    if frame is None:
        return "the interpreter"
    name = Path(frame.filename).resolve()
    return f"{name.relative_to(REPO) if name.is_relative_to(REPO) else name}:{frame.lineno}"


def _argv(args, kwargs) -> str:
    argv = args[0] if args else kwargs.get("args", "?")
    if isinstance(argv, list | tuple):
        return " ".join(os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv)
    return str(argv)


_watch = _Watch()


def _wrap(owner, name: str, describe: Callable[..., str]) -> None:
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        _watch.started(describe(*args, **kwargs))
        return original(*args, **kwargs)

    wrapped.__wrapped__ = original
    setattr(owner, name, wrapped)


def pytest_configure(config: pytest.Config) -> None:
    _wrap(_posixsubprocess, "fork_exec", lambda *a, **k: f"fork_exec({_argv(a, k)!r})")
    if hasattr(subprocess, "_fork_exec"):  # subprocess binds its own name for it at import
        subprocess._fork_exec = _posixsubprocess.fork_exec
    _wrap(os, "system", lambda command: f"os.system({command!r})")
    _wrap(os, "fork", lambda: "os.fork()")
    _wrap(os, "forkpty", lambda: "os.forkpty()")
    for spawn in ("posix_spawn", "posix_spawnp"):
        _wrap(os, spawn, lambda path, argv, *a, name=spawn, **k: f"{name}({_argv((argv,), {})!r})")
    # a Python whose subprocess starts processes some other way would make every check above pass
    _watch.probe = []
    subprocess.run([sys.executable, "-c", ""], check=True)
    seen, _watch.probe = _watch.probe, None
    if not seen:
        raise pytest.UsageError("tests/process_guard.py does not see subprocess start a process on this Python")


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    _watch.fixtures.append(fixturedef)
    try:
        return (yield)
    finally:
        _watch.fixtures.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _watch.item = item
    try:
        return (yield)
    finally:
        _watch.item = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if report.when == "call":
        item.stash[_ran] = not report.skipped
    return report


_ran = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield
    if _watch.outside_tests:  # reported with the test after them: under xdist a worker has no summary of its own
        outside, _watch.outside_tests = _watch.outside_tests, []
        pytest.fail(
            "processes started outside any test (at collection or in a hook): `-m 'not e2e'` starts them too\n  "
            + "\n  ".join(outside),
            pytrace=False,
        )
    started = _watch.for_item(item)
    marked = item.get_closest_marker(MARKER) is not None
    if started and not marked:
        shown = started[:SHOWN] + ([f"... and {len(started) - SHOWN} more"] if len(started) > SHOWN else [])
        pytest.fail(
            f"starts a process but is not marked {MARKER} (-m 'not e2e' must start none):\n  " + "\n  ".join(shown),
            pytrace=False,
        )
    if marked and not started and item.stash.get(_ran, False):
        pytest.fail(f"marked {MARKER} but starts no process: drop the marker", pytrace=False)
    return result


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _watch.by_library and config.get_verbosity() > 0:
        terminalreporter.section("processes started by libraries on their own behalf")
        for line, count in _watch.by_library.most_common():
            terminalreporter.write_line(f"{count:4d}  {line}")
