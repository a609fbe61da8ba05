"""File descriptors: how many connections the API may hold without starving the rest of the node.

The API shares its process's descriptors with the gRPC server, the expert files and the Hub's
sockets. Were idle HTTP connections to take them all, gRPC clients would get UNAVAILABLE and peers
would mark the node down. So the API holds at most half of the soft limit, whatever its
own cap says, and `serve` first raises the soft limit towards the hard one: macOS starts processes
at 256, which would leave the API 128 connections.
"""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger(__name__)

TARGET_OPEN_FILES = 8192  # enough for the API's default cap (4,096) and as much again for the node
MIN_CONNECTIONS = 16


def raise_open_file_limit(target: int = TARGET_OPEN_FILES) -> int:
    """Raise this process's soft RLIMIT_NOFILE to `target` (never above the hard limit, never
    lowering it); the soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:  # macOS refuses more than kern.maxfilesperproc
            logger.info("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft


def connection_cap(requested: int) -> int:
    """`requested`, but no more than half the soft open-file limit in force now."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max(MIN_CONNECTIONS, requested)
    return max(MIN_CONNECTIONS, min(requested, soft // 2))
