"""Which experts go to the Hub as one request: runs of experts lying back to back in a shard.

A request pays its time to first byte once, which is most of what a small expert's transfer
costs; a run of adjacent experts pays it once for all of them. A run trades parallelism for fewer
requests, though: a connection carries a run at its own share of the link, so while connections
are free, one request per expert is faster. Both the store's demands and its idle-link fill plan
runs here; K3's 17.5 MB experts are each several pieces already and never form one.
"""

from __future__ import annotations

from collections.abc import Callable

from expertmesh.node.model.expert_index import ExpertIndex, run_ranges
from expertmesh.node.store.stats import ExpertKey


def demand_runs(
    index: ExpertIndex, keys: list[ExpertKey], connections: int, min_piece_bytes: int
) -> list[list[ExpertKey]]:
    """`keys` (one layer's demands, sorted) grouped into runs, only where there are more of them
    than connections: a run then holds at most as many experts as it takes to bring the layer's
    requests down to the number of connections, and stays within one piece (`min_piece_bytes`)."""
    if len(keys) <= connections:
        return [[k] for k in keys]
    longest = -(-len(keys) // connections)
    runs: list[list[ExpertKey]] = []
    for key in keys:
        if runs and runs[-1][-1] == (key[0], key[1] - 1) and len(runs[-1]) < longest:
            locs = [index.expert(*k) for k in (*runs[-1], key)]
            if sum(loc.nbytes for loc in locs) <= min_piece_bytes and run_ranges(locs) is not None:
                runs[-1].append(key)
                continue
        runs.append([key])
    return runs


def fill_run(
    index: ExpertIndex,
    first: ExpertKey,
    longest: int,
    run_bytes: int,
    wanted: Callable[[ExpertKey], bool],
    has_room: Callable[[int], bool],
) -> list[ExpertKey]:
    """`first` and the experts after it in its shard that idle-link fill may take with it: wanted,
    fitting the disk's free room, at most `longest` experts and `run_bytes` bytes in all."""
    run = [first]
    while len(run) < longest:
        nxt = (first[0], run[-1][1] + 1)
        if nxt not in index.experts or not wanted(nxt):
            break
        locs = [index.expert(*k) for k in (*run, nxt)]
        size = sum(loc.nbytes for loc in locs)
        if size > run_bytes or not has_room(size) or run_ranges(locs) is None:
            break
        run.append(nxt)
    return run
