"""Conversations with the prefix cache on and off, side by side in one run (issue 45): now
`expertmesh bench --conversation` (expertmesh/devtools/bench_conversation.py); this runs it.

    python benchmarks/bench_conversation.py [--model demo|tiny-ARCH|k3-proportions] [--turns 6]
        [--steps 12] [--system-tokens 1500] [--tokens 12] [--json FILE]
"""

from __future__ import annotations

import sys

from expertmesh.cli import main

FLAGS = ("--model", "--turns", "--steps", "--system-tokens", "--tokens", "--json")  # passed on as they are

if __name__ == "__main__":
    sys.exit(main(["bench", "--conversation", *sys.argv[1:]]))
