"""The part of grpc's `ServicerContext` the node's servicer uses, typed.

grpc ships no types, so a checker takes `context.abort(...)` for a call that returns, and every
check that ends a call with it for one that falls through. `abort` raises (it ends the call with
its status); `NoReturn` says so, and the code after a refusal is then read as it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn, Protocol

import grpc


class CallContext(Protocol):
    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """End the call with `code` and `details` (raises)."""
        ...

    def is_active(self) -> bool:
        """Whether the client is still there."""
        ...

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None: ...
