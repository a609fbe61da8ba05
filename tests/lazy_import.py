"""A client library imported on its first use rather than at collection.

Every xdist worker collects every test module, so a module-level import is paid by each worker,
whether or not it runs a test that uses the library. `anthropic` takes about 1.5 s to import on
these machines (its typed models), more than most tests take to run.

Not importlib's LazyLoader: its module loads on any attribute read, and pytest's collection reads
attributes of every module global (`__class__` for an isinstance check, its fixture markers), so
the library was imported at collection all the same (seen with `-X importtime`).
"""

from __future__ import annotations

import importlib
from typing import Any


class _Deferred:
    """Stands for module `name`; its public attributes import it. Private and special names
    (what pytest probes while collecting) answer as a plain object's do."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


def lazy_import(name: str) -> Any:
    """`name`, imported when one of its public attributes is first read."""
    return _Deferred(name)
