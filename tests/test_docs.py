"""README.md and docs/ against the program: users follow them literally, so every command, flag,
file path, environment variable and metric name they state must exist at HEAD.

Cheap and in process: the CLI's own parser (nothing is run), the benchmark scripts' source, the
metric declarations and the files of the repository. What the commands print is checked by the
tests of each command; this catches a doc that names something the code does not have, and a
flag the code has that no doc explains.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import plistlib
import re
from pathlib import Path

import huggingface_hub.constants
import pytest

from expertmesh.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "deploy" / "README.md", ROOT / "deploy" / "launchd" / "README.md"] + sorted(
    (ROOT / "docs").glob("*.md")
)
USAGE = ROOT / "docs" / "usage.md"
# `expertmesh WORD` in prose that is not a command ("expertmesh runs ...", "expertmesh node")
PROSE = {"is", "runs", "with", "on", "keeps", "cannot", "node", "home"}
FLAG = re.compile(r"(?<![\w-])(--?[a-z][a-z0-9-]*)")


def _commands() -> dict[str, set[str]]:
    """command -> its option strings, from the real parser."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: {o for a in sp._actions for o in a.option_strings} for name, sp in sub.choices.items()}


def _invocations(text: str) -> list[tuple[str, str]]:
    """(command, the rest of its line) for every `expertmesh CMD ...` written in `text`: in code
    spans, code blocks and prose lines alike; a span ends at a backtick, pipe, `;`, `&` or `#`."""
    found = []
    for line in text.splitlines():
        for piece in re.split(r"`", line):
            for m in re.finditer(r"(?<![\w/.-])expertmesh ([a-z][a-z-]*)([^|;&#]*)", piece):
                found.append((m.group(1), m.group(2)))
    return found


def _readme_table_rows() -> list[tuple[str, str]]:
    """(command, flags) of README's command table: `| \\`pull REPO [--revision R]\\` | ... |`."""
    text = (ROOT / "README.md").read_text().split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^\| `([a-z][a-z-]*)([^`]*)` \|", text, re.M)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_and_flag_a_doc_names_exists(doc: Path) -> None:
    commands = _commands()
    wrong = []
    for cmd, rest in _invocations(doc.read_text()):
        if cmd in PROSE:
            continue
        if cmd not in commands:
            wrong.append(f"expertmesh {cmd}: no such command")
            continue
        wrong += [f"expertmesh {cmd} {flag}: no such flag" for flag in FLAG.findall(rest) if flag not in commands[cmd]]
    assert not wrong, f"{doc.name}: " + "; ".join(wrong)


def test_readme_command_table_matches_the_parser() -> None:
    commands = _commands()
    rows = _readme_table_rows()
    assert {cmd for cmd, _ in rows} == set(commands), "README's command table lists other commands than the CLI has"
    wrong = [f"{cmd} {flag}" for cmd, rest in rows for flag in FLAG.findall(rest) if flag not in commands[cmd]]
    assert not wrong, f"README's command table names flags the commands do not have: {wrong}"
    section = (ROOT / "README.md").read_text().split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    cells = {line.count("|") - line.count("\\|") for line in section.splitlines() if line.startswith("| `")}
    assert cells == {3}, "a README command table row has a stray `|`: it renders as a broken table"


def test_every_flag_of_every_command_is_explained_in_usage() -> None:
    """A user finds every flag in docs/usage.md (README points there for them)."""
    usage = USAGE.read_text()
    missing = [
        f"{cmd} {flag}"
        for cmd, flags in _commands().items()
        for flag in sorted(flags)
        if flag.startswith("--") and flag != "--help" and not re.search(rf"(?<![\w-]){flag}(?![\w-])", usage)
    ]
    assert not missing, f"flags docs/usage.md does not mention: {missing}"


def test_benchmark_commands_in_docs_name_real_scripts_and_flags() -> None:
    wrong = []
    for doc in DOCS:
        for m in re.finditer(r"benchmarks/(\w+\.py)([^\n`|;&#]*)", doc.read_text()):
            script = ROOT / "benchmarks" / m.group(1)
            if not script.exists():
                wrong.append(f"{doc.name}: {script.name} does not exist")
                continue
            source = script.read_text()
            wrong += [
                f"{doc.name}: {script.name} {flag}"
                for flag in FLAG.findall(m.group(2))
                if flag.startswith("--") and f'"{flag}"' not in source
            ]
    assert not wrong, f"benchmark commands the scripts do not take: {wrong}"


def test_every_environment_variable_a_doc_names_is_read() -> None:
    """Ours are read by the code; HF_* by huggingface_hub itself (its constants and its auth)."""
    code = "\n".join(p.read_text() for d in ("node", "coordinator", "expertmesh") for p in (ROOT / d).rglob("*.py"))
    hub_package = Path(huggingface_hub.constants.__file__).parent
    hub = (hub_package / "constants.py").read_text() + (hub_package / "utils" / "_auth.py").read_text()
    named = {v for doc in DOCS for v in re.findall(r"\b((?:EXPERTMESH|HF)_[A-Z0-9_]+)", doc.read_text())}
    assert named, "the docs name no environment variable: the pattern is wrong"
    unread = sorted(v for v in named if f'"{v}"' not in (hub if v.startswith("HF_") else code))
    assert not unread, f"environment variables the docs name and nothing reads: {unread}"


def _declared_metrics() -> set[str]:
    """Every metric family the node and the API declare, with the suffixes a scrape shows."""
    names = set()
    for path in (ROOT / "node" / "observability" / "metrics.py", ROOT / "coordinator" / "api_metrics.py"):
        text = path.read_text()
        names |= {"expertmesh_" + n for n in re.findall(r'PREFIX \+ "(\w+)"', text)}
        names |= set(re.findall(r'"(expertmesh_\w+)"', text))
    # counters are exposed with _total; histograms as the name (their own series add suffixes)
    return names | {n + "_total" for n in names}


def test_every_metric_a_doc_names_is_declared() -> None:
    declared = _declared_metrics()
    assert "expertmesh_tokens_generated_total" in declared, "the declaration pattern is wrong"
    wrong = []
    for doc in DOCS:
        for name in set(re.findall(r"\bexpertmesh_[a-z_*]+[a-z*]", doc.read_text())):
            if not fnmatch.filter(declared, name):
                wrong.append(f"{doc.name}: {name}")
    assert not wrong, f"metrics the docs name that no node exports: {wrong}"


def test_every_repository_path_a_doc_names_exists() -> None:
    wrong = []
    pattern = r"(?<![\w./-])((?:node|coordinator|expertmesh|tests|deploy|benchmarks|proto|scripts|docs)/[\w./-]*\w)"
    for doc in DOCS:
        for path in set(re.findall(pattern, doc.read_text())):
            if re.fullmatch(r"expertmesh/[\w-]+", path):  # a Hub repo id (expertmesh/demo-kimi-k3), not a path
                continue
            if not any(p.exists() for p in (ROOT / path, doc.parent / path)):
                wrong.append(f"{doc.name}: {path}")
    # the old flat paths benchmarks.md cites on purpose ("was node/bench.py"), and a file made at run time
    allowed = {"node/bench.py", "node/cache_policies.py", "node/hub_source.py", "deploy/prometheus/targets/nodes.json"}
    wrong = [w for w in wrong if w.split(": ", 1)[1] not in allowed]
    assert not wrong, f"paths the docs name that do not exist: {wrong}"


def _class_attributes() -> dict[str, set[str]]:
    """class name -> the names its body defines, for every class in the package's source."""
    found: dict[str, set[str]] = {}
    for path in [
        *(ROOT / "node").rglob("*.py"),
        *(ROOT / "coordinator").rglob("*.py"),
        *(ROOT / "expertmesh").rglob("*.py"),
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = found.setdefault(node.name, set())
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
    return found


def test_every_method_the_architecture_walk_names_exists() -> None:
    """docs/architecture.md walks a token and an expert through `Class.method`s: a renamed method
    must take the page with it, or a newcomer follows a name that is not there."""
    classes = _class_attributes()
    text = (ROOT / "docs" / "architecture.md").read_text()
    wrong = []
    for cls, attr in set(re.findall(r"`([A-Z]\w+)\.(\w+)", text)):
        if cls in classes and attr not in classes[cls]:
            wrong.append(f"{cls}.{attr}")
        elif cls not in classes and not cls.startswith(("Switch", "Quantized")):  # mlx-lm's own classes
            wrong.append(f"{cls} (no such class)")
    assert not wrong, f"docs/architecture.md names what the code does not have: {sorted(wrong)}"


@pytest.mark.parametrize("plist", sorted((ROOT / "deploy" / "launchd").glob("*.plist")), ids=lambda p: p.name)
def test_launchd_services_run_a_command_the_cli_takes(plist: Path) -> None:
    """deploy/launchd/README.md installs these as they are: their arguments must parse."""
    service = plistlib.loads(plist.read_bytes())
    program, *args = service["ProgramArguments"]
    assert program.endswith("/expertmesh")
    parsed = build_parser().parse_args(args)  # exits (SystemExit) on an unknown flag or a bad value
    assert parsed.command == "serve"
    assert "EXPERTMESH_HOME" in service.get("EnvironmentVariables", {}), "docs/macos.md's sed edits that key"
