"""tests/process_guard.py keeps the `e2e` mark true both ways: a pytest run of made-up tests, in
its own process, fails each one whose mark disagrees with what it starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CASES = """
import subprocess, sys, threading
import pytest

def _start():
    subprocess.run([sys.executable, "-c", ""], check=True)

def test_unmarked_clean():
    pass

def test_unmarked_starts_one():
    _start()

def test_unmarked_starts_one_in_a_thread():
    t = threading.Thread(target=_start)
    t.start()
    t.join()

@pytest.fixture(scope="module")
def server():
    _start()

def test_unmarked_sets_up_a_fixture_that_starts_one(server):
    pass

def test_unmarked_uses_that_fixture_set_up_before(server):
    pass

@pytest.mark.e2e
def test_marked_starts_one():
    _start()

@pytest.mark.e2e
def test_marked_starts_none():
    pass

@pytest.mark.e2e
def test_marked_skipped():
    pytest.skip("not judged: it did not run")
"""


def _pytest(folder: Path, cases: str) -> subprocess.CompletedProcess:
    """pytest with process_guard on a module of `cases`, in its own process and folder."""
    (folder / "conftest.py").write_text('pytest_plugins = ["process_guard"]\n')
    (folder / "test_cases.py").write_text(cases)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-o", "markers=e2e: e2e", "."],
        cwd=folder,
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.e2e
def test_a_mark_that_disagrees_with_what_a_test_starts_fails_it(tmp_path: Path) -> None:
    r = _pytest(tmp_path, CASES)
    outcomes = {
        name: kind for kind, name in re.findall(r"^(PASSED|ERROR|FAILED) test_cases\.py::(\w+)", r.stdout, re.M)
    }
    assert outcomes == {
        "test_unmarked_clean": "PASSED",
        "test_unmarked_starts_one": "ERROR",
        "test_unmarked_starts_one_in_a_thread": "ERROR",
        "test_unmarked_sets_up_a_fixture_that_starts_one": "ERROR",
        "test_unmarked_uses_that_fixture_set_up_before": "ERROR",
        "test_marked_starts_one": "PASSED",
        "test_marked_starts_none": "ERROR",
    }, r.stdout + r.stderr  # a PASSED call is followed by its teardown's ERROR
    assert "1 skipped" in r.stdout  # test_marked_skipped did not run: not judged
    assert r.stdout.count("starts a process but is not marked e2e") == 4
    assert "test_cases.py:6" in r.stdout  # the line that started it
    assert "marked e2e but starts no process" in r.stdout


@pytest.mark.e2e
def test_a_process_started_while_collecting_fails_the_first_test(tmp_path: Path) -> None:
    r = _pytest(
        tmp_path, 'import subprocess, sys\nsubprocess.run([sys.executable, "-c", ""])\n\ndef test_clean():\n    pass\n'
    )
    assert "ERROR test_cases.py::test_clean" in r.stdout, r.stdout + r.stderr
    assert "processes started outside any test" in r.stdout and "test_cases.py:2" in r.stdout
