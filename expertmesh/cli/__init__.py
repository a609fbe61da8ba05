"""The `expertmesh` command: a thin dispatcher over one module per command group.

    models     pull
    generate   run, chat, demo
    serve      serve
    household  peers, status, warm, prometheus-targets
    tools      hub, tiny-model, bench, replay
    local      ls, rm, cache, doctor

Each group parses its flags into the node's config dataclasses (expertmesh/node/config.py) and
calls the library; errors meant for the user become one line on stderr and a non-zero exit code,
never a traceback.
"""

from __future__ import annotations

import os
import warnings

# Set before anything imports transformers (mlx-lm's tokenizers do): it reads these once.
# It warns that it does not know our model types and that rope_scaling is deprecated in
# configs it only reads for the tokenizer; neither is the user's business.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
warnings.filterwarnings("ignore", message=r".*rope_scaling.*", category=FutureWarning)

import argparse  # noqa: E402 - after the settings above, by design
import logging  # noqa: E402
import sys  # noqa: E402

from expertmesh.cli import generate, household, local, models, serve, tools  # noqa: E402
from expertmesh.node.errors import ExpertmeshError  # noqa: E402

GROUPS = (models, generate, serve, household, local, tools)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="expertmesh",
        description="Run trillion-parameter Mixture-of-Experts models on the Macs of a household.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (retries, fetches)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in GROUPS:
        group.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # huggingface_hub's bars for small files would interleave with ours
    try:
        return args.func(args)
    except ExpertmeshError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("\ninterrupted: what was fetched is kept; run the same command again to resume", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader left (`| head`): end quietly, as `cat` does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return 141
    except OSError as e:  # the home, a trace file, a port: the system's own words, and where
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        if args.verbose:
            raise
        return 1


if __name__ == "__main__":
    sys.exit(main())
