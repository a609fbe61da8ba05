"""The fetch path's figures held against a recorded baseline: `bench --model k3-proportions --baseline`.

Two figures of `expertmesh bench --model k3-proportions` say whether the decode fetch path still
does what it did: the node's CPU seconds per GB the Hub sent it (`node_cpu_s_per_gb`), and the
share of the link that moved bytes a token waited for (`useful_link_use`). Both fell back once
without a test noticing (issue 44), because nothing compared them with an earlier run.

A baseline file (benchmarks/fetch_path_baseline.json) records the run's shape (the repo's
proportions, the configurations, the per-connection caps, tokens) and each row's two figures,
with the commit and the machine's load when it was measured. `--baseline FILE` runs that same
shape and compares row by row; a figure beyond its tolerance (CPU per GB more than `cpu_slack`
above, useful link more than `link_slack` below) is a regression, and the command exits 1. The
tolerances are wide because these figures move with the machine's load: the check catches a
doubling, not a few percent. `--record-baseline FILE` writes a new baseline from a run.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

FIGURES = ("node_cpu_s_per_gb", "useful_link_use")
DEFAULT_CPU_SLACK = 0.25  # CPU per GB may be this much above the baseline's
DEFAULT_LINK_SLACK = 0.10  # useful link may be this much below the baseline's


class BaselineError(ValueError):
    """A baseline file that cannot be used: unreadable, or missing what a comparison needs."""


@dataclass(frozen=True)
class Shape:
    """What a run is, so that the check runs what the baseline measured."""

    experts: int
    moe_layers: int
    router: str
    configs: tuple[str, ...]
    per_connection: tuple[float, ...]
    tokens: int


@dataclass(frozen=True)
class Compared:
    """One figure of one row beside its baseline."""

    config: str
    per_connection: float
    figure: str
    baseline: float
    measured: float | None
    limit: float  # the worst value still within the tolerance

    @property
    def ratio(self) -> float | None:
        return None if self.measured is None or not self.baseline else self.measured / self.baseline

    @property
    def regressed(self) -> bool:
        if self.measured is None:
            return True  # a figure the baseline has and the run did not give is not a pass
        if self.figure == "node_cpu_s_per_gb":
            return self.measured > self.limit
        return self.measured < self.limit


def load(path: Path) -> tuple[Shape, dict]:
    """The baseline at `path`: its shape and its document.

    Raises:
        BaselineError: not JSON, or without the shape or rows a comparison reads.
    """
    try:
        doc = json.loads(Path(path).read_text())
        s = doc["shape"]
        shape = Shape(
            experts=int(s["experts"]),
            moe_layers=int(s["moe_layers"]),
            router=str(s["router"]),
            configs=tuple(s["configs"]),
            per_connection=tuple(float(c) for c in s["per_connection"]),
            tokens=int(s["tokens"]),
        )
        for row in doc["rows"]:
            _ = row["name"], float(row["per_connection_bytes_per_s"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BaselineError(f"{path}: not a fetch-path baseline ({type(e).__name__}: {e})") from None
    return shape, doc


def record(doc: dict, shape: Shape, path: Path, cpu_slack: float = DEFAULT_CPU_SLACK) -> dict:
    """Write the baseline of the bench document `doc`, which ran `shape`, to `path`; returns it."""
    rows = [
        {
            "name": r["name"],
            "per_connection_bytes_per_s": r["per_connection_bytes_per_s"],
            **{f: r.get(f) for f in FIGURES},
        }
        for r in doc["configs"]
        if r["name"] in shape.configs and any(r.get(f) is not None for f in FIGURES)
    ]
    baseline = {
        "about": "expertmesh bench --model k3-proportions --baseline FILE compares a run of this shape with these rows "
        "(expertmesh/devtools/fetch_baseline.py)",
        "commit": _commit(),
        "load": list(doc.get("load", [])),
        "shape": {**asdict(shape), "configs": list(shape.configs), "per_connection": list(shape.per_connection)},
        "cpu_slack": cpu_slack,
        "link_slack": DEFAULT_LINK_SLACK,
        "rows": rows,
    }
    Path(path).write_text(json.dumps(baseline, indent=2) + "\n")
    return baseline


def compare(doc: dict, baseline: dict) -> list[Compared]:
    """Each figure of each baseline row beside the same row of the run `doc`."""
    cpu_slack = float(baseline.get("cpu_slack", DEFAULT_CPU_SLACK))
    link_slack = float(baseline.get("link_slack", DEFAULT_LINK_SLACK))
    measured = {(r["name"], float(r["per_connection_bytes_per_s"])): r for r in doc["configs"]}
    out = []
    for row in baseline["rows"]:
        key = (row["name"], float(row["per_connection_bytes_per_s"]))
        got = measured.get(key, {})
        for figure in FIGURES:
            base = row.get(figure)
            if base is None:
                continue
            limit = base * (1 + cpu_slack) if figure == "node_cpu_s_per_gb" else base * (1 - link_slack)
            out.append(Compared(key[0], key[1], figure, float(base), got.get(figure), limit))
    return out


def print_comparison(compared: list[Compared], baseline: dict, out=print) -> bool:
    """Print the comparison; returns whether every figure is within its tolerance."""
    load = ", ".join(f"{x:.2f}" for x in baseline.get("load", []))
    out(f"against the baseline of {baseline.get('commit') or 'an unknown commit'} (load then {load or '?'}):")
    for c in compared:
        got = "-" if c.measured is None else f"{c.measured:.2f}"
        ratio = "" if c.ratio is None else f" ({c.ratio:.2f}x)"
        bound = "at most" if c.figure == "node_cpu_s_per_gb" else "at least"
        verdict = "REGRESSED" if c.regressed else "ok"
        out(
            f"  {c.config:<15} {c.per_connection / 1e6:>6.1f} MB/s {c.figure:<18} {got:>6} vs {c.baseline:.2f}"
            f"{ratio}, {bound} {c.limit:.2f}: {verdict}"
        )
    return not any(c.regressed for c in compared)


def _commit() -> str | None:
    """The checkout's commit, if this runs in one."""
    try:
        r = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None
