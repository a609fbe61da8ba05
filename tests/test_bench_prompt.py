"""`expertmesh bench --configs prompt`: the rows a user reads a prompt's cost from.

On the demo model with its link sped up: the disk row must read the prompt's experts from disk only
(it starts from the disk its cold row left, not from an untimed run), every row must read each
expert once, and the first token must equal mlx-lm's.
"""

from __future__ import annotations

import pytest

from expertmesh.devtools import bench_prompt

pytestmark = pytest.mark.e2e  # the bench's Hub and its node processes


@pytest.fixture(scope="module")
def sixteen_token_rows() -> dict:
    return bench_prompt.run("demo", (16,), time_scale=0.02, progress=lambda _: None)


def test_the_cold_and_disk_rows_read_each_expert_once_and_equal_mlx_lm(sixteen_token_rows: dict) -> None:
    rows = {r["cache"]: r for r in sixteen_token_rows["configs"]}
    assert set(rows) == {"cold", "disk"}
    for r in rows.values():
        assert r["prompt_tokens"] == 16 and r["prefill"] == "layer_major"
        assert r["tokens_reference"] == "mlx_lm" and r["tokens_equal"] is True
        assert r["distinct_experts"] > 0 and r["fetch_redundancy"] <= 1.05
        assert r["compute_measured"] == "resident"
        assert r["ttft_over_floor"] == pytest.approx(r["ttft_s"] / r["floor_s"])
        assert r["plan_bytes"] > 0  # the plan beside the peak it should hold
    assert rows["cold"]["uses_by_source"]["hub"] > 0
    # the cold row's disk, taken over: every expert of the prompt is there, none comes from the Hub
    assert rows["disk"]["uses_by_source"]["hub"] == 0
    assert rows["disk"]["uses_by_source"]["disk"] == rows["disk"]["distinct_experts"]
    assert rows["disk"]["distinct_experts"] == rows["cold"]["distinct_experts"]


def test_the_table_names_every_row(sixteen_token_rows: dict) -> None:
    lines: list[str] = []
    bench_prompt.print_table(sixteen_token_rows, out=lines.append)
    assert [line.split()[:3] for line in lines[1:3]] == [["16", "cold", "layer_major"], ["16", "disk", "layer_major"]]
    assert lines[-1].startswith("load average:")
