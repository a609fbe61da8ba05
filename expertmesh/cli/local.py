"""`ls`, `rm`, `cache` and `doctor`: this machine's models, caches and readiness.

What a user of `ollama` or `huggingface-cli` expects day to day: see what is pulled and how much
of each model's experts is on disk, remove a model, check or shrink the expert cache, and ask
whether this Mac is ready. Listing never locks or changes anything, so it is safe beside a
running node; deleting goes through the disk tier's own lock and refuses while a node keeps the
cache (node/store/maintenance.py). Tables are plain aligned text, as the other commands print.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from expertmesh.cli import arguments
from expertmesh.node import constants
from expertmesh.node.errors import ExpertmeshError
from expertmesh.node.sizes import format_size, parse_budget


def add_commands(sub) -> None:
    p = sub.add_parser("ls", help="pulled models: core size, experts cached on disk, last used")
    p.add_argument("repo", nargs="?", type=arguments.repo_id, help="only this repo id")
    p.set_defaults(func=ls)

    p = sub.add_parser("rm", help="remove a pulled model: its core and its expert cache (asks first)")
    p.add_argument("repo", type=arguments.repo_id, help="Hugging Face repo id of a pulled model")
    p.add_argument("--revision", help="only this revision (a name pinned at pull time, or a commit sha); default all")
    p.add_argument("-y", "--yes", action="store_true", help="delete without asking (needed when stdin is no terminal)")
    p.set_defaults(func=rm)

    p = sub.add_parser("cache", help="the expert cache by model; --verify its files, --prune it to a size")
    p.add_argument("repo", nargs="?", type=arguments.repo_id, help="only this repo id's cache")
    p.add_argument("--revision", help="only this revision of REPO (a name pinned at pull time, or a commit sha)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every expert file against its recorded sha256 and delete bad ones (fetched again when "
        "needed); `expertmesh verify REPO` checks the recorded digests themselves against the Hub",
    )
    p.add_argument(
        "--prune",
        metavar="SIZE",
        help="delete the least recently used experts until the caches (or REPO's) hold at most SIZE "
        "(a size like 100GB, or a %% of what they hold now); with --prefixes, the prompt prefixes instead",
    )
    p.add_argument(
        "--prefixes",
        action="store_true",
        help="the prompt prefixes full nodes keep on disk (1,024 tokens or more, under the home's prefixes/) "
        "instead of the experts: list them, or --prune them to SIZE, least recently used first",
    )
    p.set_defaults(func=cache)

    p = sub.add_parser(
        "doctor", help="is this machine ready: memory, disk, Metal, ports, the Hub, the household, the clock"
    )
    defaults = serve_defaults()
    p.add_argument("--host", default=defaults["host"], help="the address `serve` binds gRPC on (default %(default)s)")
    p.add_argument(
        "--port", type=arguments.port, default=defaults["port"], help="serve's gRPC port (default %(default)s)"
    )
    p.add_argument("--http-host", default=defaults["http_host"], help="the API's address (default %(default)s)")
    p.add_argument(
        "--http-port", type=arguments.port, default=defaults["http_port"], help="serve's API port (default %(default)s)"
    )
    p.add_argument(
        "--metrics-port",
        type=arguments.port,
        default=defaults["metrics_port"],
        help="serve's /metrics port (default %(default)s: a free one)",
    )
    p.add_argument(
        "--cluster", default=defaults["cluster"], help="the household's zeroconf cluster (default %(default)s)"
    )
    p.add_argument("--interface", metavar="IP", help="browse on this address only")
    p.add_argument("--no-discovery", dest="discover", action="store_false", help="do not look for the household")
    p.add_argument(
        "--wait", type=arguments.seconds, default=3.0, help="seconds to listen for the household (default %(default)s)"
    )
    g = p.add_argument_group(
        "memory plan", "--plan MODEL prints only the memory plan of MODEL, for this machine or --memory"
    )
    g.add_argument(
        "--plan",
        metavar="MODEL",
        help="k3 (Kimi K3, computed from its shape) or the repo id of a model pulled here",
    )
    g.add_argument(
        "--memory",
        type=arguments.mac_memory,
        metavar="SIZE",
        help="plan for a Mac with this much memory (64GB counts as 64 GiB; its recommended working set is "
        "taken as three quarters); default: this machine",
    )
    g.add_argument(
        "--core-bits",
        type=int,
        choices=[16, 8, 4],
        metavar="{16,8,4}",
        help="the core at these bits (default: as pulled)",
    )
    g.add_argument(
        "--core-quant", metavar="RECIPE", help="the core quantised with mlx-lm's mixed recipe (mixed_4_6...)"
    )
    g.add_argument(
        "--prompt-tokens",
        type=arguments.positive_int,
        metavar="N",
        help="also what a prompt of N tokens costs before its first token, cold and warm: its experts' "
        "expected union, each read once (node/prompt_cost.py)",
    )
    g.add_argument(
        "--link",
        type=_rate,
        default="100MB",
        metavar="B",
        help="--prompt-tokens: the link's bytes/s to the Hub (default %(default)s, a home link)",
    )
    g.add_argument(
        "--disk-rate",
        type=_rate,
        default="2GB",
        metavar="B",
        help="--prompt-tokens: the disk's parallel-read bytes/s (default %(default)s, a Mac's SSD)",
    )
    g.add_argument(
        "--disk-share",
        type=float,
        default=0.25,
        metavar="F",
        help="--prompt-tokens: the share of the experts on this Mac's disk, for the cost of each --prompt-experts "
        "mode (default %(default)s: a quarter, as a 350 GB disk holds of K3's; node/prompt_mode_cost.py)",
    )
    g.add_argument(
        "--prompt-budget",
        type=float,
        default=60.0,
        metavar="S",
        help="--prompt-tokens: the seconds of --prompt-experts budget:S planned (default %(default)s)",
    )
    g.add_argument("--json", metavar="FILE", help="also write the plan as JSON to FILE")
    arguments.add_memory_arguments(g)
    g.add_argument(
        "--ram-budget",
        type=arguments.budget,
        default=constants.DEFAULT_RAM_BUDGET,
        help="RAM for experts as `run` takes it (default %(default)s)",
    )
    p.set_defaults(func=doctor)


def serve_defaults() -> dict:
    """`serve`'s own defaults for the flags doctor checks, read from its parser so the two never drift."""
    from expertmesh.cli import serve

    sub = argparse.ArgumentParser(add_help=False).add_subparsers()
    serve.add_commands(sub)
    p = sub.choices["serve"]
    names = ("host", "port", "http_host", "http_port", "metrics_port", "metrics_host", "cluster")
    return {name: p.get_default(name) for name in names}


def _ago(t: float | None) -> str:
    if t is None:
        return "never"
    s = max(0.0, time.time() - t)
    for unit, n in (("day", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            k = int(s // n)
            return f"{k} {unit}{'s' if unit == 'day' and k > 1 else ''} ago"
    return "just now"


def _share(nbytes: int, of: int | None) -> str:
    return f"{100 * nbytes / of:.1f}%" if of else "-"


# -- ls ---------------------------------------------------------------------------------------


def ls(args: argparse.Namespace) -> int:
    """One line per pulled revision; caches whose model is gone are listed after."""
    from expertmesh.node.hub import local_models
    from expertmesh.node.store import maintenance

    home = constants.expertmesh_home()
    models = local_models.pulled_models(home, args.repo)
    caches = {(c.repo_id, c.commit): c for c in maintenance.all_usage(home, args.repo)}
    if not models and not caches:
        print(f"no models in {home}: `expertmesh pull REPO` pulls one")
        return 0
    header = f"{'MODEL':<36} {'REVISION':<10} {'COMMIT':<12}  {'CORE':>16}  {'EXPERTS ON DISK':>34}  LAST USED"
    print(header)
    core_total = cached_total = 0
    for m in models:
        c = caches.pop((m.repo_id, m.commit), None) or maintenance.usage(home, m.repo_id, m.commit)
        if m.state == "complete":
            core = format_size(m.core_bytes) + (f" {m.core_bits}-bit" if m.core_bits != 16 else "")
            core_total += m.core_bytes
        elif m.state == "index":
            core = "index only"
        else:
            core = f"unfinished {format_size(m.disk_bytes)}"
        of = f" of {m.expert_count}" if m.expert_count else ""
        experts = f"{format_size(c.nbytes)}, {c.experts}{of} ({_share(c.nbytes, m.expert_bytes)})"
        cached_total += c.nbytes
        used = max((t for t in (local_models.last_used(m.path), c.last_used) if t is not None), default=None)
        refs = ",".join(m.refs) or "-"
        print(f"{m.repo_id:<36} {refs:<10} {m.commit[:12]:<12}  {core:>16}  {experts:>34}  {_ago(used)}")
    for c in caches.values():  # a cache whose model folder is gone: kept until `rm`
        cached_total += c.nbytes
        experts = f"{format_size(c.nbytes)}, {c.experts}"
        print(f"{c.repo_id:<36} {'-':<10} {c.commit[:12]:<12}  {'not pulled':>16}  {experts:>34}  {_ago(c.last_used)}")
    print(f"{home}: cores {format_size(core_total)}, experts cached {format_size(cached_total)}")
    return 0


# -- rm ---------------------------------------------------------------------------------------


def _commit(home: Path, repo: str, revision: str | None) -> str | None:
    """The commit --revision names here (None: every revision); an unknown one is an error."""
    from expertmesh.node.hub import local_models

    if revision is None:
        return None
    commit = local_models.local_commit(home, repo, revision)
    if commit is None:
        raise ExpertmeshError(f"{repo}@{revision} is not pulled here (`expertmesh ls {repo}` shows what is)")
    return commit


def _confirm(question: str) -> bool:
    """Ask on the terminal; the question goes to stderr so stdout stays what `rm` did."""
    print(question, end=" ", file=sys.stderr, flush=True)
    answer = sys.stdin.readline()
    return answer.strip().lower() in ("y", "yes")


def rm(args: argparse.Namespace) -> int:
    """Delete a model's revision folders and expert caches, after a yes (or with --yes)."""
    from expertmesh.node.store import maintenance

    home = constants.expertmesh_home()
    removal = maintenance.plan_removal(home, args.repo, _commit(home, args.repo, args.revision))
    if removal.empty:
        raise ExpertmeshError(f"nothing of {args.repo} in {home} (`expertmesh ls` shows what is there)")
    for m in removal.models:
        print(f"  {m.path}  ({'core and index' if m.state == 'complete' else m.state}, {format_size(m.disk_bytes)})")
    for c in removal.caches:
        print(f"  {c.root}  (expert cache: {c.experts} experts, {format_size(c.nbytes)})")
    sys.stdout.flush()
    size = format_size(removal.nbytes)
    if not args.yes:
        if sys.stdin is None or not sys.stdin.isatty():
            raise ExpertmeshError(
                f"rm asks before deleting {size}, but stdin is not a terminal: pass --yes to delete without asking"
            )
        if not _confirm(f"delete these ({size})? [y/N]"):
            print("nothing deleted")
            return 1
    maintenance.remove(home, removal)
    print(f"removed {args.repo}: {size} freed")
    return 0


# -- cache ------------------------------------------------------------------------------------


def cache(args: argparse.Namespace) -> int:
    """Usage by model; with --verify and/or --prune, those (verify first), then the usage after."""

    if args.revision and not args.repo:
        raise ExpertmeshError("--revision needs REPO")
    home = constants.expertmesh_home()
    commit = _commit(home, args.repo, args.revision) if args.repo else None
    status = 0
    if args.prefixes:
        return _prefixes(home, args.prune)
    if args.verify:
        status |= _verify(home, args.repo, commit)
    if args.prune is not None:
        status |= _prune(home, args.repo, commit, args.prune)
    _usage(home, args.repo, commit)
    return status


def _prefixes(home: Path, prune: str | None) -> int:
    from expertmesh.node.engine.prefix_disk import prune_prefixes, stored_prefixes
    from expertmesh.node.sizes import parse_budget

    root = home / "prefixes"
    if prune is not None:
        total = sum(p.nbytes for p in stored_prefixes(root))
        gone = prune_prefixes(root, parse_budget(prune, total))
        print(f"deleted {gone} prompt prefix file(s)")
    stored = stored_prefixes(root)
    if not stored:
        print(f"no prompt prefixes kept in {root}")
        return 0
    print(f"{'COMMIT':<12}  {'TOKENS':>7}  {'SIZE':>10}  LAST USED")
    for p in reversed(stored):
        print(f"{p.commit[:12]:<12}  {p.tokens:>7}  {format_size(p.nbytes):>10}  {_ago(p.used)}")
    print(f"total {format_size(sum(p.nbytes for p in stored))} in {len(stored)} prefix(es)")
    return 0


def _caches(home: Path, repo: str | None, commit: str | None):
    from expertmesh.node.store import maintenance

    return [c for c in maintenance.all_usage(home, repo) if commit is None or c.commit == commit]


def _usage(home: Path, repo: str | None, commit: str | None) -> None:
    import shutil

    from expertmesh.node.hub import local_models

    caches = _caches(home, repo, commit)
    if not caches:
        print(f"no experts cached in {home / 'experts'}")
        return
    print(f"{'MODEL':<36} {'COMMIT':<12}  {'EXPERTS':>8}  {'SIZE':>10}  {'SHARE':>6}  LAST USED")
    for c in caches:
        pulled = local_models.pulled_models(home, c.repo_id)
        total = next((m.expert_bytes for m in pulled if m.commit == c.commit), None)
        share = _share(c.nbytes, total) if c.pulled else "gone"
        print(
            f"{c.repo_id:<36} {c.commit[:12]:<12}  {c.experts:>8}  {format_size(c.nbytes):>10}  {share:>6}  "
            f"{_ago(c.last_used)}"
        )
    free = shutil.disk_usage(home).free
    print(f"total {format_size(sum(c.nbytes for c in caches))} in {len(caches)} cache(s); {format_size(free)} free")


def _verify(home: Path, repo: str | None, commit: str | None) -> int:
    """1 if a bad file was found (and deleted) or a cache could not be checked."""
    from tqdm.auto import tqdm

    from expertmesh.node.store import maintenance

    status = 0
    for c in _caches(home, repo, commit):
        name = f"{c.repo_id}@{c.commit[:12]}"
        if not c.pulled:
            print(f"{name}: not checked: the model is not pulled here (`expertmesh rm {c.repo_id}` removes its cache)")
            continue
        with tqdm(total=c.nbytes, unit="B", unit_scale=True, desc=f"verify {c.repo_id}", disable=None) as bar:
            report = maintenance.verify(home, c.repo_id, c.commit, progress=bar.update)
        print(
            f"{name}: {report.checked} experts checked ({format_size(report.checked_bytes)}), "
            f"{len(report.bad)} bad deleted, {len(report.dropped_at_open)} unverifiable deleted"
        )
        for (layer, expert), why in report.bad:
            print(f"  deleted expert {expert} of layer {layer}: {why}")
        if report.dropped_at_open:
            print(f"  deleted {len(report.dropped_at_open)} file(s) of the wrong size or with no recorded sha256")
        if report.stray_folders:
            print(
                f"  {len(report.stray_folders)} folder(s) where an expert's file belongs, left alone: remove them "
                f"(first: {report.stray_folders[0]})"
            )
            status = 1
        if report.unverified:
            print(
                f"  {report.unverified} good ones match a digest from one fetch only: "
                f"`expertmesh verify {c.repo_id}` confirms them against the Hub"
            )
        if report.deleted:
            status = 1
    return status


def _prune(home: Path, repo: str | None, commit: str | None, size: str) -> int:
    """1 if the caches could not be brought within `size` (caches of models no longer pulled)."""
    from expertmesh.node.store import maintenance

    if commit is not None:
        raise ExpertmeshError("--prune works on whole caches: leave --revision out")
    held = sum(c.nbytes for c in _caches(home, repo, None))
    try:
        budget = parse_budget(size, held)
    except ValueError as e:
        raise ExpertmeshError(f"--prune: {e}") from None
    report = maintenance.prune(home, budget, repo)
    freed = sum(n for _, _, n in report.deleted)
    print(
        f"pruned {len(report.deleted)} experts ({format_size(freed)}), least recently used first: "
        f"{format_size(report.before_bytes)} -> {format_size(report.after_bytes)} (at most {format_size(budget)})"
    )
    if not report.within:
        names = ", ".join(f"{c.repo_id}@{c.commit[:12]}" for c in report.not_pulled)
        print(f"  still above it: the caches of {names} belong to models no longer pulled; `expertmesh rm` them")
        return 1
    return 0


# -- doctor -----------------------------------------------------------------------------------


def doctor(args: argparse.Namespace) -> int:
    """Each check on one line; exit 1 if any failed. With --plan, the memory plan alone."""
    from expertmesh.node.doctor import FAIL, WARN, DoctorSettings, run_checks

    if args.plan is not None:
        return _plan(args)

    settings = DoctorSettings(
        home=constants.expertmesh_home(),
        ports=[
            ("gRPC", args.host, args.port),
            ("API", args.http_host, args.http_port),
            ("metrics", args.host, args.metrics_port),
        ],
        cluster=args.cluster,
        interface=args.interface,
        wait_s=args.wait,
        discover=args.discover,
    )
    checks = run_checks(settings)
    for check in checks:
        print(check.line(), flush=True)
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    print(f"{len(checks) - fails - warns} ok, {warns} warn, {fails} fail")
    return 1 if fails else 0


def _rate(text: str) -> float:
    """Bytes a second: `100MB` is 100 MB/s."""
    from expertmesh.node.sizes import parse_size

    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError("a rate above 0")
    return float(n)


def _prompt_cost(args: argparse.Namespace):
    """The prompt cost of --plan MODEL: K3's shape, or the pulled repo's index and config."""
    import json

    from expertmesh.node.hub import local_models
    from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex
    from expertmesh.node.model.mlx_lm_models import top_k_of
    from expertmesh.node.prompt_cost import PromptCost

    if args.plan.lower() in ("k3", "kimi-k3", "moonshotai/kimi-k3"):
        shape = (constants.K3_MOE_LAYERS, constants.K3_EXPERTS_PER_LAYER, constants.K3_TOP_K, constants.K3_EXPERT_BYTES)
    else:
        path = local_models.find_pulled(constants.expertmesh_home(), args.plan)
        index = ExpertIndex.load(path / INDEX_FILENAME)
        per_layer = max(sum(1 for lay, _ in index.experts if lay == layer) for layer in index.moe_layers)
        top_k = top_k_of(json.loads((path / "config.json").read_text())) or 1
        shape = (len(index.moe_layers), per_layer, top_k, max(loc.nbytes for loc in index.experts.values()))
    return PromptCost(args.prompt_tokens, *shape, args.link, args.disk_rate)


def _plan(args: argparse.Namespace) -> int:
    """The plan of --plan MODEL on one line, what would hold its core whole, --json; exit 0 when
    the core fits whole, 1 when it would be streamed or does not fit at all."""
    import json

    from expertmesh.node.doctor import plan_model
    from expertmesh.node.engine.memory import CoreTooLargeError

    planned = plan_model(
        constants.expertmesh_home(),
        args.plan,
        args.memory,
        max_context=args.max_context,
        core_bits=args.core_bits,
        core_quant=args.core_quant,
        ram_budget=args.ram_budget,
        core_budget=args.core_budget,
        prefix_cache=args.prefix_cache,
    )
    changes = planned.planner.changes()
    try:
        plan = planned.planner.plan()
    except CoreTooLargeError as e:
        doc = {"fits": False, "streamed": False, "error": str(e)}
        print(f"{planned.title}: does not fit: {e}")
    else:
        doc = plan.as_json()
        print(f"{planned.title}: {plan.parts()}")
        if plan.streamed:
            print("  the core does not fit whole: it would be streamed from the SSD every token")
        else:
            print("  fits: the core is held whole")
    if changes:
        print("  to hold the core whole: " + ", or ".join(changes))
    doc.update(model=args.plan, computed=planned.computed, changes=changes)
    if args.prompt_tokens:
        cost = _prompt_cost(args)
        for line in cost.lines():
            print(line)
        from expertmesh.node import prompt_mode_cost

        modes = prompt_mode_cost.mode_costs(cost, args.disk_share, args.prompt_budget)
        for line in prompt_mode_cost.lines(modes, args.disk_share):
            print(line)
        doc.update(prompt={**cost.as_json(), "modes": [m.as_json() for m in modes]})
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if doc["fits"] else 1
