"""Every `mlx_lm.convert -q` output of every architecture that streams: pulled, streamed, and
compared token for token with mlx-lm's greedy run of the same folder.

For each architecture of the registry (expertmesh/devtools/tiny/registry.py) with a tiny repo,
the repo is made twice — at the registry's tiny widths (an expert 32 wide: mlx-lm's default
affine groups of 64 leave its down projection unquantised, one of its predicate's exceptions)
and with experts 64 wide (every projection quantised) — and each is converted with every entry
of `QUANTS` (expertmesh/devtools/tiny/conversions.py: 2, 3, 4, 6 and 8 bits, every mixed recipe,
mxfp4, nvfp4, mxfp8), served by a local Hub, pulled and streamed. A cell reads:

    ok      streamed equal to mlx-lm (`ok*`: in float32 on this CPU, both, an expert projection dense)
    DIFF    tokens differ
    refused `pull` refused it with one line (printed below the table)
    error   a traceback anywhere else (printed below the table): a bug
    n/a     mlx-lm's convert or its own run fails on this machine (its Metal-only kernels)

    python benchmarks/bench_conversions.py [--archs glm4_moe,qwen3_moe] [--quants 4bit,mixed_4_6]
        [--widths tiny,64] [--json out.json]

Exit status 1 if any cell is DIFF or error.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from pathlib import Path

import transformers

from expertmesh.devtools.local_hub import HubServer
from expertmesh.devtools.tiny import registry
from expertmesh.devtools.tiny.conversions import QUANTS, MlxLmFails, build_upstream, compare, convert
from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.hub import client as hub_client
from expertmesh.node.model.mlx_lm_models import expert_modules

WIDE = {"moe_intermediate_size": 64, "expert_ffn_hidden_size": 64, "intermediate_size": 128, "ffn_hidden_size": 128}
WIDTHS = {"tiny": {}, "64": WIDE}


def _row(arch: str, width: str, quants: list[str], root: Path, notes: list[str]) -> dict[str, str]:
    """One architecture at one expert width: every conversion made, then served by one local Hub
    (it lists its repos when it starts), pulled and compared."""
    base = root / f"{arch}-{width}"
    upstream = base / "upstream"
    upstream.mkdir(parents=True)
    build_upstream(upstream, arch, **WIDTHS[width])
    cells: dict[str, str] = {}
    for quant in quants:
        try:
            convert(upstream, base / "hub" / "conv" / quant, quant)
        except Exception as e:  # noqa: BLE001 - mlx-lm's own convert: a cell, not the end of the matrix
            notes.append(f"{arch} ({width}) {quant}: mlx-lm's convert fails: {type(e).__name__}: {str(e)[:160]}")
            cells[quant] = "n/a"
    with HubServer(base / "hub") as server, hub_client.using_endpoint(server.url):
        for quant in quants:
            if quant not in cells:
                cells[quant] = _cell(f"{arch} ({width}) {quant}", quant, base, notes)
    return cells


def _cell(key: str, quant: str, base: Path, notes: list[str]) -> str:
    try:
        result = compare(f"conv/{quant}", base / "hub" / "conv" / quant, base / "homes" / quant)
    except UnsupportedModelError as e:
        notes.append(f"{key}: refused: {e}")
        return "refused"
    except MlxLmFails as e:
        notes.append(f"{key}: mlx-lm's own run fails: {str(e)[:200]}")
        return "n/a"
    except Exception:  # noqa: BLE001 - a bug in one cell is a cell, not the end of the matrix
        notes.append(f"{key}: {traceback.format_exc()}")
        return "error"
    if result.from_hub == 0:
        notes.append(f"{key}: no expert came from the Hub")
        return "error"
    if not result.equal:
        notes.append(f"{key}: streamed {result.streamed}, mlx-lm {result.mlx_lm}")
        return "DIFF"
    return "ok*" if result.float32 else "ok"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", help="comma list of mlx-lm modules (default: every one with a tiny repo)")
    parser.add_argument("--quants", default=",".join(QUANTS), help="comma list of QUANTS names")
    parser.add_argument("--widths", default=",".join(WIDTHS), help="comma list of: tiny, 64")
    parser.add_argument("--json", type=Path, help="write the matrix here")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()  # one warning per tokenizer loaded would bury the table
    quants = args.quants.split(",")
    widths = args.widths.split(",")
    for name in quants:
        if name not in QUANTS:
            parser.error(f"unknown quant {name!r}: choose from {', '.join(QUANTS)}")
    for name in widths:
        if name not in WIDTHS:
            parser.error(f"unknown width {name!r}: choose from {', '.join(WIDTHS)}")
    archs = args.archs.split(",") if args.archs else [a for a in expert_modules() if a not in registry.NO_MAKER]
    t0 = time.monotonic()
    matrix: dict[str, dict[str, str]] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-conversions-") as tmp:
        for arch in archs:
            for width in widths:
                row = f"{arch} ({width})"
                try:
                    matrix[row] = _row(arch, width, quants, Path(tmp), notes)
                except ValueError as e:  # the registry makes no tiny repo of it at this width
                    notes.append(f"{row}: no tiny repo: {e}")
                    continue
                print(f"{row:<32} " + " ".join(f"{matrix[row][q]:>9}" for q in quants), flush=True)
    print()
    print("| architecture (expert width) | " + " | ".join(quants) + " |")
    print("|---|" + "---|" * len(quants))
    for row, cells in matrix.items():
        print(f"| {row} | " + " | ".join(cells[q] for q in quants) + " |")
    counts: dict[str, int] = {}
    for cells in matrix.values():
        for v in cells.values():
            counts[v] = counts.get(v, 0) + 1
    print()
    print(f"{sum(counts.values())} conversions in {time.monotonic() - t0:.0f} s: {counts}")
    for note in notes:
        print(f"- {note}")
    if args.json:
        args.json.write_text(json.dumps({"matrix": matrix, "notes": notes, "counts": counts}, indent=1))
    return 1 if counts.get("DIFF") or counts.get("error") else 0


if __name__ == "__main__":
    raise SystemExit(main())
