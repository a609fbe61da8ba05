"""`python -m expertmesh` is the `expertmesh` command."""

import sys

from expertmesh.cli import main

sys.exit(main())
