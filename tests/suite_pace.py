"""How fast the suite's processes start and how many run: a pytest plugin (tests/conftest.py).

Two costs that the tests themselves do not show (measured on this project's 2-core machines,
2026-12-07):

- Compiling the project's own modules. These machines set PYTHONDONTWRITEBYTECODE, so nothing
  caches them: every xdist worker, and every `expertmesh` process an e2e test starts, compiled
  about 38,000 lines again (a worker's collection took 9.3 s; 5.4 s with caches). The controller
  now compiles them once, before any worker starts; Python reads a cache whatever that variable
  says, it only stops it being written.
- Cores left idle. About a quarter of the suite waits on sockets, subprocesses and timers (the
  suite used 149% of two cores with two workers), so `-n auto` starts one worker more than the
  cores: 4 min 32 s became 3 min 46 s for `-m "not e2e"`, the same CPU seconds.
  `PYTEST_XDIST_AUTO_NUM_WORKERS` still sets the number outright.
"""

from __future__ import annotations

import compileall
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("expertmesh", "node", "coordinator", "proto")  # what `import expertmesh...` compiles


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller compiled before starting it
        return
    for name in SOURCES:
        folder = ROOT / name
        if folder.is_dir():  # up-to-date caches are left as they are
            compileall.compile_dir(folder, quiet=1, workers=1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own reading of it
    return (os.cpu_count() or 1) + 1
