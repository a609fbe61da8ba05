"""An owner's fetch for a peer, with its progress on the wire (FetchExpert's `progress`).

A peer that asks an expert's owner for it waits while the owner fetches it from the Hub. Without
word from the owner it can only wait for the longest that fetch may run, which on a slow home
link is minutes, and an owner whose fetch is stuck while its health check answers holds it that
long for every such expert. With progress the owner says, at once and then every
`PROGRESS_EVERY_S`, whether this call's fetch has begun (it may wait behind other peers' fetches:
`ServedExperts.fetch_as_owner` runs one at a time) and how many expert bytes its links have
received so far, so the caller waits as long as those grow and gives up within a stall when they
do not (household/peers_tier.py).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Generator

from expertmesh.node.errors import Abandoned, without_locals
from expertmesh.node.model.expert_index import ExpertBytes, ExpertLocation
from expertmesh.node.rpc.call_context import CallContext
from expertmesh.node.store.served import ServedExperts
from expertmesh.v1 import node_pb2

# Often enough that a caller's stall bound (seconds to tens of seconds) sees several; each is a
# dozen bytes.
PROGRESS_EVERY_S = 2.0


def fetch_reporting_progress(
    experts: ServedExperts, loc: ExpertLocation, context: CallContext, every_s: float | None = None
) -> Generator[node_pb2.ExpertChunk, None, ExpertBytes]:
    """Yield progress messages (every `every_s`, PROGRESS_EVERY_S by default) while
    `experts.fetch_as_owner(loc)` runs on a thread of its own, and return its bytes (or raise what
    it raised). A caller that leaves stops the messages; a fetch already begun goes on, since the
    owner keeps what it fetched."""
    every_s = PROGRESS_EVERY_S if every_s is None else every_s
    begun = threading.Event()
    result: concurrent.futures.Future[ExpertBytes] = concurrent.futures.Future()

    def run() -> None:
        try:
            result.set_result(experts.fetch_as_owner(loc, context.is_active, begun.set))
        except BaseException as e:  # noqa: BLE001 - handed to the call's thread, which raises it
            result.set_exception(without_locals(e))

    threading.Thread(target=run, name=f"owner-fetch-{loc.layer}-{loc.expert}", daemon=True).start()
    while context.is_active():  # ends when the fetch does: its own deadlines bound it
        progress = node_pb2.FetchProgress(fetching=begun.is_set(), received_bytes=experts.received_bytes())
        yield node_pb2.ExpertChunk(progress=progress)
        try:
            return result.result(timeout=every_s)
        except concurrent.futures.TimeoutError:
            continue
    raise Abandoned(f"expert {loc.expert} of layer {loc.layer}: the caller left")
