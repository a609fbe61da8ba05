"""Routing traces: which experts every MoE layer asked for, pass by pass, and their replay.

A trace is JSON lines: a header (model, commit, experts per layer), then one line per MoE layer
call `{"pass": p, "layer": l, "experts": [...]}` — a pass is one forward of the model (a prefill
chunk or a decoded token). Replaying a trace through each RAM policy, and through Belady's
offline optimum, at a given budget tells which policy to run (`expertmesh replay`).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.store.policies import POLICIES, belady_hit_rate, frequency_oracle_hit_rate, hit_rate

logger = logging.getLogger(__name__)

# A trace is for `replay`: a few thousand tokens tell which policy to run. A `serve --trace` left on
# for weeks would otherwise fill the disk (Kimi K3: 92 lines, about 8 kB, per token), so recording
# stops at this size, with one warning; the file stays a valid trace.
MAX_TRACE_BYTES = 1 << 30


class TraceWriter:
    """Appends one line per MoE layer call; a new pass starts when the layer number goes down.

    Recording stops, with one warning, at `max_bytes` or at the first failed write (a full or
    failing disk): a trace is an observation, and never the reason a generation fails."""

    def __init__(self, path: Path, index: ExpertIndex, max_bytes: int = MAX_TRACE_BYTES):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.written = 0  # bytes in the file
        self.stopped: str | None = None  # why recording stopped
        layers = index.moe_layers
        experts = {str(layer): sum(1 for (lay, _) in index.experts if lay == layer) for layer in layers}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")
            self._write({"trace": 1, "repo": index.repo_id, "commit": index.commit, "experts_per_layer": experts})
        except OSError as e:  # a directory, a read-only place, a full disk: said before the model loads
            raise ExpertmeshError(f"cannot write the routing trace to {self.path}: {e.strerror or e}") from None
        self._lock = threading.Lock()
        self._pass = -1
        self._last_layer: int | None = None

    def _write(self, obj: dict) -> None:
        line = json.dumps(obj, separators=(",", ":")) + "\n"
        self._file.write(line)
        self._file.flush()  # a killed run keeps every pass so far
        self.written += len(line)

    def record(self, layer: int, experts: list[int]) -> None:
        with self._lock:
            if self.stopped is not None:
                return
            if self._last_layer is None or layer <= self._last_layer:
                self._pass += 1
            self._last_layer = layer
            line = {"pass": self._pass, "layer": layer, "experts": sorted(int(e) for e in experts)}
            try:
                self._write(line)
            except (OSError, ValueError) as e:  # ValueError: the file was closed
                self._stop(f"writing it failed ({getattr(e, 'strerror', None) or e})")
                return
            if self.written >= self.max_bytes:
                self._stop(f"it reached {self.max_bytes} bytes")

    def _stop(self, why: str) -> None:
        self.stopped = why
        logger.warning("the routing trace %s stops here: %s", self.path, why)

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as e:  # the last flush failed: what was written stays
            logger.warning("closing the routing trace %s failed: %s", self.path, e.strerror or e)


@dataclass
class Trace:
    repo: str
    commit: str
    experts_per_layer: dict[int, int]
    calls: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (pass, layer, experts)

    @property
    def total_experts(self) -> int:
        return sum(self.experts_per_layer.values())

    def accesses(self) -> list[tuple[int, int]]:
        return [(layer, e) for _, layer, experts in self.calls for e in experts]

    @property
    def passes(self) -> int:
        return len({p for p, _, _ in self.calls})


def read_trace(path: Path) -> Trace:
    """Raises ValueError for a file that is not a trace; a torn last line is skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    try:
        header = json.loads(lines[0])
        assert header.get("trace") == 1
    except (IndexError, ValueError, AssertionError):
        raise ValueError(f"{path} is not a routing trace (record one with `expertmesh run --trace FILE`)") from None
    trace = Trace(header["repo"], header["commit"], {int(k): v for k, v in header["experts_per_layer"].items()})
    for n, line in enumerate(lines[1:], 2):
        try:
            rec = json.loads(line)
            trace.calls.append((int(rec["pass"]), int(rec["layer"]), [int(e) for e in rec["experts"]]))
        except (ValueError, KeyError, TypeError):
            logger.warning("%s:%d: skipping a malformed line", path, n)
    return trace


def replay(trace: Trace, slots: list[int], policies: list[str] | None = None) -> dict[str, dict[int, float]]:
    """Hit rate of each policy, of `freq_oracle` (the trace's most used experts held all along: the
    ceiling of counting) and of `belady`, at each budget in slots (experts held)."""
    accesses = trace.accesses()
    out: dict[str, dict[int, float]] = {}
    for name in policies or list(POLICIES):
        out[name] = {n: hit_rate(name, accesses, n) for n in slots}
    out["freq_oracle"] = {n: frequency_oracle_hit_rate(accesses, n) for n in slots}
    out["belady"] = {n: belady_hit_rate(accesses, n) for n in slots}
    return out
