"""Expert pieces on parallel connections, and the bench's scaled link: plain arithmetic a user relies on."""

from __future__ import annotations

import pytest

from expertmesh.devtools.bench import K3_EXPERT_BYTES, K3_LINK, LinkSettings
from expertmesh.node.model.expert_index import ByteRange
from expertmesh.node.store.tiers.hub import split_ranges


@pytest.mark.parametrize("pieces,min_piece", [(1, 1), (4, 1), (4, 5000), (7, 100), (64, 1)])
def test_pieces_cover_every_byte_once_in_order(pieces: int, min_piece: int) -> None:
    ranges = [ByteRange("a.safetensors", 100, 10_100), ByteRange("b.safetensors", 0, 333)]
    out = split_ranges(ranges, pieces, min_piece)
    for r in ranges:  # each range is cut into contiguous pieces, never merged with another
        mine = [p for p in out if p.file == r.file]
        assert mine[0].start == r.start and mine[-1].end == r.end
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
    assert sum(p.nbytes for p in out) == sum(r.nbytes for r in ranges)
    big = [p for p in out if p.file == "a.safetensors"]
    assert len(big) <= pieces + 1 and all(p.nbytes >= min(min_piece, 10_000) for p in big)


def test_the_bench_link_keeps_k3s_proportions() -> None:
    link = LinkSettings.scaled(expert_bytes=3264, time_scale=0.05)
    k3_expert_s = K3_EXPERT_BYTES / K3_LINK["per_connection"]
    assert link.expert_bytes / link.per_connection == pytest.approx(k3_expert_s * 0.05)  # an expert's transfer
    assert link.ttfb_s / (link.expert_bytes / link.per_connection) == pytest.approx(K3_LINK["ttfb_s"] / k3_expert_s)
    assert link.bandwidth / link.per_connection == pytest.approx(8.0)  # connections that fill the link
