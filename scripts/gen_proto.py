"""Generate the Python code of proto/ beside each .proto (committed, installed as `expertmesh.v1`, checked by a test).

python scripts/gen_proto.py [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out: Path) -> list[Path]:
    """Run protoc (grpcio-tools) on every .proto file; returns the files written."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for package in sorted({Path(p).parent for p in protos}):
        init = out / package / "__init__.py"  # the package itself (pyproject maps it to `expertmesh.v1`)
        if not init.exists():
            init.write_text("")
        written += sorted((out / package).glob("*.py*"))
    return written


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=PROTO_DIR)
    for path in generate(ap.parse_args().out):
        print(path.relative_to(ROOT) if ROOT in path.parents else path, file=sys.stderr)
