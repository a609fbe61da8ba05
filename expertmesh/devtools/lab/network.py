"""Kernel-shaped links for the household lab: one network namespace per host, joined by a bridge.

Each host (the Hub, node 0 .. N-1) gets a namespace `<prefix>-<host>` with one interface `lan0`,
the end of a veth pair whose other end is a port of a Linux bridge. The bridge lives in a namespace
of its own (`<prefix>-br`), so nothing of the lab touches the machine's own network: no address of
the host is routed into it and nothing routes out. Every host's link is rate-limited in both
directions with `tc ... tbf` (egress on `lan0`, and egress on the bridge port towards it, which is
the host's ingress): a Mac's gigabit NIC is shared by everything that Mac sends or receives, and
the Hub's link is a home internet link. `netem` is not available on these machines, so latency
comes from the Hub's first-byte delay, not from the kernel.

Multicast crosses the bridge as on a real LAN (snooping off, a 224.0.0.0/4 route in every host),
so zeroconf finds the nodes as it would at home.

Everything is named with a prefix that carries the driver's pid (`eml<pid>`); `down()` deletes
the namespaces (which takes their veths and the bridge with them), and `remove_leftovers()` deletes
those of earlier labs whose process is gone — after a crash or a kill -9, the next lab cleans up.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PREFIX = "eml"  # + the driver pid: at most 10 characters, so interface names fit in 15
SUBNET = "10.213.7"  # inside the lab's own namespaces only: nothing routes to or from it
IP_TIMEOUT_S = 20.0


class LabNetworkError(RuntimeError):
    """The namespaces, veths, bridge or qdiscs could not be made."""


def available() -> str | None:
    """None when namespaces can be made here; else why not (for the fallback's message and test skips)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_NET_ADMIN"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2)"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and r.returncode != 0:
        raise LabNetworkError(f"`{' '.join(args)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lab_namespaces() -> list[str]:
    """Names of every lab namespace on this machine (any owner)."""
    r = _run("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX)]


def lab_links() -> list[str]:
    """Names of lab veth ends left in the root namespace (a crash between creating and moving them)."""
    r = _run("ip", "-o", "link", "show", check=False)
    return [m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)", r.stdout, re.M) if m.group(1).startswith(PREFIX)]


def remove_leftovers() -> list[str]:
    """Delete the namespaces and links of labs whose driver process is gone; returns their names."""
    removed = []
    for name in [*lab_namespaces(), *lab_links()]:
        m = re.match(rf"{PREFIX}(\d+)(-|[a-z])", name)
        if m is None:
            continue  # not named as a lab names things: not ours to delete
        if _pid_alive(int(m.group(1))) and int(m.group(1)) != os.getpid():
            continue  # another lab, still running
        if name in lab_namespaces():
            _run("ip", "netns", "delete", name, check=False)
        else:
            _run("ip", "link", "delete", name, check=False)
        removed.append(name)
    return removed


def _tbf(ns: str, dev: str, bytes_per_s: float) -> list[str]:
    """A tbf qdisc: `bytes_per_s` sustained. The bucket holds at least 256 KB, more than one
    segmentation-offloaded packet (64 KB), so tbf never drops a packet it could never send."""
    burst = max(256 * 1024, int(bytes_per_s / 100))
    rate_bits = int(bytes_per_s * 8)
    return [
        "ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root",
        "tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "100ms",
    ]  # fmt: skip


@dataclass
class Host:
    name: str  # "hub", "n0", ...
    namespace: str
    address: str
    bytes_per_s: float

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass
class LabNetwork:
    """The lab's hosts on one bridge. `up()` makes them; `down()` (or leaving `with`) removes them."""

    nodes: int
    lan_bytes_per_s: float = 118e6  # a gigabit Ethernet NIC, payload
    hub_bytes_per_s: float = 100e6  # a home internet link
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}-br"

    def up(self) -> LabNetwork:
        why = available()
        if why:
            raise LabNetworkError(why)
        if len(self.prefix) > 11:
            raise LabNetworkError(f"prefix {self.prefix!r} is too long for interface names (15 characters)")
        try:
            _run("ip", "netns", "add", self.bridge_ns)
            br = ["ip", "netns", "exec", self.bridge_ns]
            _run(*br, "ip", "link", "set", "lo", "up")
            _run(*br, "ip", "link", "add", "br0", "type", "bridge", "mcast_snooping", "0", "stp_state", "0")
            _run(*br, "ip", "link", "set", "br0", "up")
            specs = [("hub", self.hub_bytes_per_s)] + [(f"n{i}", self.lan_bytes_per_s) for i in range(self.nodes)]
            for i, (name, rate) in enumerate(specs):
                self.hosts[name] = self._host(name, f"{SUBNET}.{10 + i}", rate)
        except BaseException:
            self.down()
            raise
        return self

    def _host(self, name: str, address: str, rate: float) -> Host:
        ns = f"{self.prefix}-{name}"
        inside, port = f"{self.prefix}{name}a", f"{self.prefix}{name}b"
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", inside, "type", "veth", "peer", "name", port)
        _run("ip", "link", "set", inside, "netns", ns)
        _run("ip", "link", "set", port, "netns", self.bridge_ns)
        ex = ["ip", "netns", "exec", ns]
        _run(*ex, "ip", "link", "set", "lo", "up")
        _run(*ex, "ip", "link", "set", inside, "name", "lan0")
        _run(*ex, "ip", "addr", "add", f"{address}/24", "dev", "lan0")
        _run(*ex, "ip", "link", "set", "lan0", "up", "multicast", "on")
        _run(*ex, "ip", "route", "add", "224.0.0.0/4", "dev", "lan0")
        br = ["ip", "netns", "exec", self.bridge_ns]
        _run(*br, "ip", "link", "set", port, "master", "br0")
        _run(*br, "ip", "link", "set", port, "up")
        _run(*_tbf(ns, "lan0", rate))  # what the host sends
        _run(*_tbf(self.bridge_ns, port, rate))  # what it receives
        return Host(name, ns, address, rate)

    def qdiscs(self, host: str) -> str:
        """`tc qdisc show` of a host's interface: what shapes it (for the lab's printout and tests)."""
        return _run("ip", "netns", "exec", self.hosts[host].namespace, "tc", "qdisc", "show", "dev", "lan0").stdout

    def down(self) -> None:
        """Delete every namespace and link of this lab; safe to call twice or after a partial `up`."""
        for name in [*lab_namespaces(), *lab_links()]:
            if name == self.prefix or name.startswith(f"{self.prefix}-") or re.match(rf"{self.prefix}\D", name):
                if name in lab_namespaces():
                    _run("ip", "netns", "delete", name, check=False)
                else:
                    _run("ip", "link", "delete", name, check=False)
        self.hosts.clear()

    def leftovers(self) -> list[str]:
        """What of this lab still exists (empty after `down`)."""
        mine = re.compile(rf"^{self.prefix}(-|\D)")
        return [n for n in [*lab_namespaces(), *lab_links()] if mine.match(n)]

    def __enter__(self) -> LabNetwork:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()
