"""`expertmesh bench --model k3-proportions`'s warm-disk floor on a very small variant: the row
carries the disk's floor and the two fields issue 27 fixed, and what decode read from disk is
whole experts. The speed figures come from the real-size run in docs/benchmarks.md, not from here."""

from __future__ import annotations

import json

import pytest

from expertmesh.devtools import bench_k3
from expertmesh.devtools.tiny import k3_proportions

TINY = k3_proportions.Proportions(moe_layers=2, experts=16, top_k=4, latent=256, intermediate=256, hidden=64)


@pytest.mark.e2e
def test_the_warm_disk_floor_row_reports_the_disk_and_its_check(tmp_path_factory: pytest.TempPathFactory) -> None:
    doc = bench_k3.run(
        [20e6],
        tokens=2,
        configs=("warm_disk_floor",),
        progress=lambda _m: None,
        proportions=TINY,
        cache=tmp_path_factory.mktemp("bench-k3"),
    )
    rows = {r["name"]: r for r in json.loads(json.dumps(doc))["configs"]}
    row = rows["warm_disk_floor"]
    assert set(bench_k3.FIELDS) <= set(row)
    assert row["disk_bytes"] > 0 and row["disk_bytes"] % TINY.expert_bytes == 0, row
    assert row["floor_bytes_per_s"] > 0 and row["disk_wait_s"] > 0, row
    assert row["disk_wait_over_floor"] == pytest.approx(
        row["disk_wait_s"] / (row["disk_bytes"] / row["floor_bytes_per_s"]), rel=1e-6
    )
    assert row["hash_cpu_s_per_gb"] is not None and row["hash_cpu_s_per_gb"] >= 0, row
    assert row["demanded_bytes"] == 0, row  # nothing decode used came from the Hub: the disk held it all
