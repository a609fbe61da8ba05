"""`expertmesh doctor`: whether this machine is ready to run and serve, one line per check.

Every check answers ok, warn or fail with what it saw and, unless ok, the one thing to do about
it: what a person setting up a Mac needs, without reading logs. A fail is something that stops
`serve` or `run` (a taken port, an unreachable Hub, a core that does not fit even streamed); a warn
works but poorly or not as the household expects (CPU only, a core streamed from the SSD, no node
found, a clock a little off). The checks never print the Hub token or the household secret, only
where each came from.

`doctor --plan MODEL` prints instead the memory plan of a model (`k3`, or a repo id pulled here)
on this machine or on a Mac of `--memory` bytes (`plan_model`): what the core, the context, the
RAM tier and the buffers take, and the single changes that would hold the core whole.

The zeroconf browse runs in the background while the other checks go on, so the whole doctor
takes about its `wait_s`.
"""

from __future__ import annotations

import contextlib
import email.utils
import errno
import functools
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from expertmesh.node import constants
from expertmesh.node.errors import DamagedModelError, ExpertmeshError
from expertmesh.node.hub import local_models
from expertmesh.node.sizes import format_size, parse_budget

if TYPE_CHECKING:  # imported where used: doctor still runs, and says so, where MLX does not load
    from expertmesh.node.engine.model_sizes import Planner
    from expertmesh.node.household.discovery import Browser, Sighting

OK, WARN, FAIL = "ok", "warn", "fail"
CLOCK_WARN_S = 30.0  # beyond this, expiry of signed CDN links and TLS certificates is misjudged
CLOCK_FAIL_S = 300.0  # beyond this, the Hub's signed download links fail outright
LOW_DISK_BYTES = 20 * 10**9  # the expert cache takes half the free space by default: below this it holds little
HTTP_TIMEOUT_S = 10.0
MACOS = sys.platform == "darwin"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f"; fix: {self.fix}" if self.fix and self.status != OK else ""
        return f"{self.status:<5} {self.name:<12} {self.detail}{fix}"


@dataclass
class DoctorSettings:
    home: Path
    ports: list[tuple[str, str, int]] = field(default_factory=list)  # (what, host, port) as `serve` binds them
    cluster: str = "home"
    interface: str | None = None
    wait_s: float = 3.0  # zeroconf: seconds to listen (a browser asks at once and again after a second)
    discover: bool = True


def run_checks(s: DoctorSettings) -> list[Check]:
    """Every check, in the order a person fixes things: the machine, the network, the household."""
    household = HouseholdProbe(s.home, s.cluster, s.interface) if s.discover else None
    started = time.monotonic()
    checks = [metal(), memory(s.home), disk(s.home)]
    checks += [port(what, host, number) for what, host, number in s.ports]
    checks += hub(s.home)
    if household is not None:
        time.sleep(max(0.0, s.wait_s - (time.monotonic() - started)))
        checks.append(household.finish())
    checks.append(secret(s.home))
    return checks


# -- the machine ------------------------------------------------------------------------------


def metal() -> Check:
    """MLX on Metal, or why not: Rosetta, no GPU, or (off macOS) the CPU backend."""
    try:
        import mlx.core as mx
    except ImportError as e:
        return Check("metal", FAIL, f"MLX does not load ({e})", "pip install -U 'mlx>=0.32.3' in this environment")
    version = mx.__version__  # type: ignore[attr-defined]  # mlx's stubs omit the version it has
    if mx.metal.is_available():
        info = mx.device_info()
        working_set = int(info.get("max_recommended_working_set_size", 0))
        return Check(
            "metal",
            OK,
            f"{info.get('device_name', 'Apple GPU')}, MLX {version}, recommended working set "
            f"{format_size(working_set)}",
        )
    if MACOS and _rosetta():
        return Check(
            "metal",
            FAIL,
            "this Python runs as x86_64 under Rosetta: MLX has no Metal there",
            "install an arm64 Python (Homebrew's on Apple Silicon, or python.org's universal2) and recreate the venv",
        )
    if MACOS:
        return Check(
            "metal",
            FAIL,
            f"MLX {version} sees no Metal GPU",
            "expertmesh needs an Apple Silicon Mac on macOS 14 or later; then pip install -U mlx",
        )
    return Check(
        "metal",
        WARN,
        f"CPU only (MLX {version} on {platform.machine()} {sys.platform}): fine for the tiny and demo models",
        "run real models on an Apple Silicon Mac",
    )


def _rosetta() -> bool:
    if platform.machine() == "arm64":
        return False
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["sysctl", "-n", "sysctl.proc_translated"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() == "1"
    return False


def physical_memory() -> int | None:
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def available_memory() -> int | None:
    """Memory programs can have without swapping: Linux' MemAvailable; on macOS the free,
    inactive, speculative and purgeable pages of `vm_stat`."""
    with contextlib.suppress(OSError, ValueError, IndexError, subprocess.SubprocessError):
        if not MACOS:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
            return None
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5).stdout
        page = int(out.split("page size of", 1)[1].split()[0])
        pages = {}
        for line in out.splitlines()[1:]:
            name, _, value = line.partition(":")
            with contextlib.suppress(ValueError):
                pages[name.strip()] = int(value.strip().rstrip("."))
        kinds = ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable")
        return page * sum(pages.get(k, 0) for k in kinds)
    return None


def memory(home: Path) -> Check:
    """The machine's memory against the largest core pulled here: the memory plan
    (node/engine/memory.py) of that model, held whole, streamed, or not at all."""
    from expertmesh.node.engine.memory import CoreTooLargeError

    total, available = physical_memory(), available_memory()
    if total is None:
        return Check("memory", WARN, "cannot read this machine's memory size", "")
    seen = format_size(total) + (f", {format_size(available)} available" if available is not None else "")
    pulled = [m for m in local_models.pulled_models(home) if m.state == "complete"]
    if not pulled:
        return Check("memory", OK, f"{seen}; no model pulled yet")
    big = max(pulled, key=lambda m: m.core_bytes)
    try:
        planned = plan_model(home, big.repo_id, revision=big.commit)
        plan = planned.planner.plan()
    except CoreTooLargeError as e:
        return Check("memory", FAIL, f"{seen}; {e}", _changes(plan_model(home, big.repo_id, revision=big.commit)))
    except (ExpertmeshError, OSError, ValueError) as e:
        return Check("memory", WARN, f"{seen}; no plan for {big.repo_id}: {e}", f"`expertmesh pull {big.repo_id}`")
    line = f"{seen}; {planned.title}: {plan.parts()}"
    if plan.streamed:
        return Check("memory", WARN, line, _changes(planned) or "a Mac with more memory holds the core whole")
    return Check("memory", OK, line)


def _changes(planned: PlannedModel) -> str:
    changes = planned.planner.changes()
    return ("to hold the core whole: " + ", or ".join(changes)) if changes else ""


@functools.cache
def _k3_sizes():
    """K3's sizes, computed once per process (its model takes a second to build and probe)."""
    from expertmesh.node.engine.model_sizes import ModelSizes, kimi_k3_config

    return ModelSizes(kimi_k3_config())


@dataclass
class PlannedModel:
    planner: Planner
    title: str  # "K3 on a 64 GB Mac", "org/model on this machine"
    computed: bool  # the core's size computed from its shape, not read from pulled files


def plan_model(
    home: Path,
    model: str,
    memory: int | None = None,
    *,
    revision: str | None = None,
    max_context: int = constants.DEFAULT_MAX_CONTEXT,
    core_bits: int | None = None,
    core_quant: str | None = None,
    ram_budget: str = constants.DEFAULT_RAM_BUDGET,
    core_budget: str | None = None,
    fetch_workers: int = constants.EXPERT_FETCH_CONCURRENCY,
    prefix_cache: str = constants.DEFAULT_PREFIX_CACHE,
) -> PlannedModel:
    """The memory plan of `model` ("k3", or a repo id pulled here) on this machine or on a Mac of
    `memory` bytes, with the core at `core_bits`/`core_quant` (default: as pulled; BF16 for K3).

    Raises:
        NotPulledError: a repo id that is not pulled here.
        DamagedModelError: its local files cannot be read (`pull` repairs them).
        CoreBitsError: a bad `core_bits`/`core_quant`.
    """
    from expertmesh.node.constants import K3_EXPERT_BYTES
    from expertmesh.node.engine.core_quantization import check_core_format, format_name
    from expertmesh.node.engine.memory import device_memory, mac
    from expertmesh.node.engine.model_sizes import ModelSizes, Planner
    from expertmesh.node.engine.model_thread import model_thread
    from expertmesh.node.engine.streamed_core import file_layout
    from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex

    bits, recipe = check_core_format(core_bits, core_quant)
    device = mac(memory) if memory is not None else device_memory()
    machine = f"a {memory / 1024**3:g} GB Mac" if memory is not None else "this machine"
    if model.lower() in ("k3", "kimi-k3", "moonshotai/kimi-k3"):
        sizes = _k3_sizes()
        layout = model_thread().call(sizes.layout, bits or 16, recipe)
        planner = Planner("moonshotai/Kimi-K3", sizes, device, K3_EXPERT_BYTES, layout, core_bits=bits or 16)
        planner.prefix_cache_bytes = parse_budget(prefix_cache, 0)
        title, computed = f"K3 on {machine} (computed from its shape, not measured)", True
    else:
        path = local_models.find_pulled(home, model, revision)
        marker = local_models.read_marker(path)
        pulled = (marker.get("core_bits", 16), marker.get("core_quant"))
        computed = bits is not None and (bits, recipe) != pulled
        try:
            index = ExpertIndex.load(path / INDEX_FILENAME)
            sizes = ModelSizes(json.loads((path / "config.json").read_text()))
            layout = file_layout(path, format_name(*pulled)) if not computed else None
        except (OSError, ValueError, KeyError, TypeError) as e:  # a cut shard, a garbled config or index
            raise DamagedModelError(
                f"the local copy of {model} in {path} is damaged ({type(e).__name__}: {str(e)[:200]}): "
                f"`expertmesh pull {model}` repairs it"
            ) from None
        if computed:
            layout = model_thread().call(sizes.layout, bits, recipe)
        expert = max((loc.nbytes for loc in index.experts.values()), default=0)
        planner = Planner(model, sizes, device, expert, layout, core_bits=bits or pulled[0], pulled_bits=pulled[0])
        planner.prefix_cache_bytes = parse_budget(prefix_cache, 0)
        title = f"{model} on {machine}" + (" (its core computed at those bits, not measured)" if computed else "")
    planner.max_context, planner.ram_budget, planner.core_budget = max_context, ram_budget, core_budget
    planner.fetch_workers = fetch_workers
    model_thread().call(sizes.context_bytes, max_context)  # probed once, where MLX runs
    model_thread().call(sizes.prompt_bytes, max_context)  # the model built there too
    return PlannedModel(planner, title, computed)


def disk(home: Path) -> Check:
    """Free space where the home is, and whether the home can be written at all."""
    where = home
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError as e:
        return Check(
            "disk", FAIL, f"cannot read the disk of {home} ({e.strerror})", "set EXPERTMESH_HOME to a local folder"
        )
    cached = local_models.folder_bytes(home / "experts")
    seen = f"{format_size(free)} free at {where}" + (f"; expert caches take {format_size(cached)}" if cached else "")
    if not os.access(where, os.W_OK):
        return Check("disk", FAIL, f"{where} is not writable", "chown it to you, or set EXPERTMESH_HOME elsewhere")
    if free < constants.DISK_HEADROOM_BYTES:
        return Check("disk", FAIL, seen, "free some space, or `expertmesh cache --prune SIZE`")
    if free < LOW_DISK_BYTES:
        return Check(
            "disk",
            WARN,
            f"{seen}: little room for cached experts",
            "free space, or put EXPERTMESH_HOME on a larger disk",
        )
    return Check("disk", OK, seen)


# -- the network ------------------------------------------------------------------------------

_PORT_FLAGS = {"gRPC": "--port", "API": "--http-port", "metrics": "--metrics-port"}


def port(what: str, host: str, number: int) -> Check:
    """Whether `serve` can bind `host:number`; a port held by a running expertmesh node is fine."""
    name = f"port {what}"
    if number == 0:
        return Check(name, OK, "a free port is picked at start")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
        try:
            s.bind((host, number))
            return Check(name, OK, f"{host}:{number} is free")
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return Check(
                    name, FAIL, f"cannot bind {host}:{number} ({e.strerror})", f"serve with {_PORT_FLAGS[what]} N"
                )
    if _expertmesh_answers(what, number):
        return Check(name, OK, f"{host}:{number} is in use by a running expertmesh node")
    return Check(
        name,
        FAIL,
        f"{host}:{number} is taken by another program",
        f"find it with `lsof -nP -iTCP:{number} -sTCP:LISTEN`, or serve with {_PORT_FLAGS[what]} N",
    )


def _expertmesh_answers(what: str, number: int) -> bool:
    """Whether what listens on `number` is an expertmesh node: its gRPC health check, its API's
    /healthz, or a /metrics that exports expertmesh's metrics."""
    if what == "gRPC":
        from expertmesh.node.rpc.client import NodeClient

        with NodeClient(f"127.0.0.1:{number}", "doctor") as client:  # health needs no secret
            return client.serving(timeout=2.0)
    import http.client

    path, sign = ("/healthz", b'"status"') if what == "API" else ("/metrics", b"expertmesh_")
    conn = http.client.HTTPConnection("127.0.0.1", number, timeout=2.0)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status == 200 and sign in r.read(1 << 20)
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def hub(home: Path) -> list[Check]:
    """The Hub: reachable, the token accepted, the pulled revisions still there, and this clock
    against its `Date` header. Uses huggingface_hub's endpoint, token and HTTP session, as pulls do."""
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import get_token
    from huggingface_hub.utils import build_hf_headers

    from expertmesh.node.hub.client import endpoint
    from expertmesh.node.hub.rate_limit import observed_session

    where = endpoint()
    if hf_constants.HF_HUB_OFFLINE:
        detail = f"offline (HF_HUB_OFFLINE is set): experts not yet on disk cannot be fetched from {where}"
        return [Check("hub", WARN, detail, "unset HF_HUB_OFFLINE")]
    token = get_token()
    source = "HF_TOKEN" if os.environ.get("HF_TOKEN") else "the stored login"
    session, headers = observed_session(), build_hf_headers()  # observed: the Hub's RateLimit headers
    asked = time.time()
    try:
        r = session.get(f"{where}/api/whoami-v2", headers=headers, timeout=HTTP_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - whatever the transport raised is the finding itself
        return [
            Check(
                "hub",
                FAIL,
                f"cannot reach {where} ({type(e).__name__})",
                "check the network, HTTPS_PROXY or HF_ENDPOINT",
            ),
            Check("clock", WARN, "not checked: the Hub did not answer", "run doctor again once the Hub answers"),
        ]
    answered = time.time()
    return [
        Check("hub", OK, f"{where} answers (HTTP {r.status_code} in {answered - asked:.2f} s)"),
        _token(token, source, r),
        _models(home, where, session, headers),
        _quota(),
        _clock(r.headers.get("date"), asked, answered),
    ]


def _token(token: str | None, source: str, r) -> Check:
    if token is None:
        return Check("token", OK, "none: public models only (gated ones need HF_TOKEN)")
    if r.status_code == 200:
        try:
            who = r.json().get("name") or "a user"
        except (ValueError, AttributeError):
            who = "a user"
        return Check("token", OK, f"from {source}, accepted for {who}")
    if r.status_code == 401:
        return Check(
            "token",
            FAIL,
            f"the token from {source} is refused (HTTP 401)",
            "`hf auth login` again, or set HF_TOKEN to a token from https://huggingface.co/settings/tokens",
        )
    return Check("token", OK, f"from {source}; this endpoint does not check tokens (HTTP {r.status_code})")


def _models(home: Path, where: str, session, headers: dict) -> Check:
    """A HEAD of each pulled revision's config.json: its experts must stay fetchable from the Hub."""
    from huggingface_hub import hf_hub_url

    pulled = [m for m in local_models.pulled_models(home) if m.state in ("complete", "index")]
    if not pulled:
        return Check("models", OK, "none pulled here yet")
    refused, gone, unanswered = [], [], []
    for m in pulled:
        url = hf_hub_url(m.repo_id, "config.json", revision=m.commit, endpoint=where)
        try:
            status = session.head(url, headers=headers, follow_redirects=False, timeout=HTTP_TIMEOUT_S).status_code
        except Exception as e:  # noqa: BLE001 - the Hub answered a moment ago: transient, and named below
            unanswered.append(f"{m.repo_id} ({type(e).__name__})")
            continue
        if status in (401, 403):
            refused.append(m.repo_id)
        elif status >= 400:
            gone.append(f"{m.repo_id}@{m.commit[:12]} (HTTP {status})")
    if refused:
        return Check(
            "models",
            FAIL,
            f"the Hub refuses {', '.join(refused)} to this token",
            "accept the model's terms on its Hub page, and set HF_TOKEN to a token with access",
        )
    if gone:
        return Check(
            "models",
            FAIL,
            f"no longer on the Hub: {', '.join(gone)}; experts not on disk cannot be fetched",
            "pull the current revision (`expertmesh pull REPO`), then `expertmesh rm` the old one",
        )
    if unanswered:
        return Check("models", WARN, f"no answer for {', '.join(unanswered)}", "run doctor again")
    return Check("models", OK, f"every pulled revision is on the Hub ({len(pulled)})")


def _quota() -> Check:
    """What is left of the Hub's rate limits in this window, as its answers to the checks above
    announced it (RateLimit headers; node/hub/rate_limit.py): the `resolvers` bucket is what every
    expert fetched from the Hub spends, shared by every node behind this IP (or this account)."""
    from expertmesh.node.hub.rate_limit import DOCS_URL, GATE, QUOTA_WARN_SHARE

    # bucket -> (left, quota, seconds until it resets)
    usage = {
        b: (u.left, u.quota, u.resets_in_s)
        for b, u in GATE.usage().items()
        if u.quota is not None and u.left is not None
    }
    if not usage:
        return Check("quota", OK, "the Hub announces no rate limits here")
    shown = ", ".join(
        f"{b} {left:,} of {quota:,} left (resets in {resets_s:.0f} s)"
        for b, (left, quota, resets_s) in sorted(usage.items())
    )
    low = [b for b, (left, quota, _) in usage.items() if left < QUOTA_WARN_SHARE * quota]
    if low:
        return Check(
            "quota",
            WARN,
            f"the Hub's rate limits this window: {shown}",
            f"log in for a larger quota (`hf auth login`, or set HF_TOKEN), or wait for the window ({DOCS_URL})",
        )
    return Check("quota", OK, f"the Hub's rate limits this window: {shown}")


def _clock(date: str | None, asked: float, answered: float) -> Check:
    """This clock against the Hub's `Date` (1 s resolution, compared with the middle of the request)."""
    try:
        theirs = email.utils.parsedate_to_datetime(date).timestamp() if date else None
    except (TypeError, ValueError):
        theirs = None
    if theirs is None:
        return Check("clock", WARN, "not checked: the Hub sent no Date header", "")
    skew = (asked + answered) / 2 - theirs
    seen = f"{abs(skew):.0f} s {'ahead of' if skew > 0 else 'behind'} the Hub"
    fix = (
        "System Settings > General > Date & Time: set time automatically (or `sudo sntp -sS time.apple.com`)"
        if MACOS
        else "turn on NTP (`sudo timedatectl set-ntp true`)"
    )
    if abs(skew) >= CLOCK_FAIL_S:
        return Check("clock", FAIL, f"{seen}: the Hub's signed download links fail", fix)
    if abs(skew) >= CLOCK_WARN_S:
        return Check("clock", WARN, f"{seen}: signed links and TLS may misjudge expiry", fix)
    return Check("clock", OK, seen)


# -- the household ----------------------------------------------------------------------------


class HouseholdProbe:
    """Zeroconf browsing for the household's advertisements, started at once, read by `finish`."""

    def __init__(self, home: Path, cluster: str, interface: str | None):
        self.home, self.cluster = home, cluster
        self._seen: dict[str, Sighting] = {}
        self._lock = threading.Lock()
        self.error: OSError | None = None
        self._browser: Browser | None = None
        try:
            from expertmesh.node.household.discovery import Browser

            self._browser = Browser(self._changed, [interface] if interface else None)
        except OSError as e:
            self.error = e

    def _changed(self, name: str, sighting: Sighting | None) -> None:
        with self._lock:
            if sighting is None:
                self._seen.pop(name, None)
            else:
                self._seen[name] = sighting

    def finish(self) -> Check:
        if self._browser is not None:
            self._browser.wait_resolved()
            self._browser.close()
        if self.error is not None:
            return Check(
                "household",
                FAIL,
                f"zeroconf could not start ({self.error.strerror or self.error})",
                "check --interface and the firewall; nodes can still be reached with --peer HOST:PORT",
            )
        own = _read(self.home / "node_id")
        with self._lock:
            everyone = list(self._seen.values())
        sightings = [s for s in everyone if s.ad.node_id != own]
        mine = any(s.ad.node_id == own and s.ad.cluster == self.cluster for s in everyone)
        ours = [s for s in sightings if s.ad.cluster == self.cluster]
        others = sorted({s.ad.cluster for s in sightings} - {self.cluster})
        also = "; this machine's own node too" if mine else ""
        if ours:
            nodes = ", ".join(f"{s.ad.node_id} at {s.address} ({s.ad.role})" for s in ours[:4])
            more = f" and {len(ours) - 4} more" if len(ours) > 4 else ""
            return Check("household", OK, f"{len(ours)} node(s) in cluster {self.cluster!r}: {nodes}{more}{also}")
        if mine:
            elsewhere = f" (other clusters seen: {', '.join(map(repr, others))})" if others else ""
            return Check(
                "household", OK, f"only this machine's own node advertises in cluster {self.cluster!r}{elsewhere}"
            )
        if others:
            return Check(
                "household",
                WARN,
                f"no node in cluster {self.cluster!r}, but nodes in {', '.join(map(repr, others))}",
                f"serve with --cluster {self.cluster}, or look with --cluster {others[0]}",
            )
        if constants.household_secret() is None and not (self.home / constants.SECRET_FILENAME).exists():
            return Check("household", OK, "no node advertises and this machine has no household secret: it runs alone")
        allow = ", and allow Local Network for your terminal (System Settings > Privacy & Security)" if MACOS else ""
        return Check(
            "household",
            WARN,
            f"no node of cluster {self.cluster!r} advertised on the LAN",
            "start `expertmesh serve` on the other Macs; if they run, multicast is blocked (Wi-Fi client "
            f"isolation, a firewall){allow}: use --peer HOST:PORT",
        )


def _read(path: Path) -> str | None:
    with contextlib.suppress(OSError):
        return path.read_text().strip() or None
    return None


def secret(home: Path) -> Check:
    """Where the household secret comes from (never the secret), and whether others can read it."""
    from expertmesh.node.rpc.auth import loosely_readable

    if constants.household_secret() is not None:
        return Check("secret", OK, "from EXPERTMESH_SECRET")
    path = home / constants.SECRET_FILENAME
    if not path.exists():
        return Check("secret", OK, f"none yet: the first `expertmesh serve` creates {path}")
    if loosely_readable(path):
        return Check("secret", WARN, f"{path} is readable by other users of this machine", f"chmod 600 {path}")
    return Check("secret", OK, f"{path} (owner-only)")
