"""Workers in network namespaces on one bridge: links shaped, blackholed or cut at will.

Each namespace gets a veth pair whose host end sits on a private bridge; the bridge
holds the host's address on the subnet, where the control plane listens. `shape` caps
the traffic into one namespace with tc; a cut drops every packet between two namespaces
(iptables in both), so each still reaches the control plane and every other worker:
only the one link is gone. Used by the benches that need real link speeds and by the
reliability tests that break links.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess


def available() -> str:
    """Why namespaces cannot be used here ("" when they can)."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "iptables", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = f"kvrs-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return ""


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True)


class NetnsLab:
    """A bridge, one namespace per member, and `cut(a, b)` between members."""

    def __init__(self, members: tuple[str, ...]) -> None:
        tag = f"{random.randrange(16**4):04x}"
        self.subnet = f"10.201.{random.randrange(1, 250)}"
        self.bridge = f"kvb{tag}"
        self.host_ip = f"{self.subnet}.1"
        self.namespaces = {name: f"kvrs-{tag}-{i}" for i, name in enumerate(members)}
        self.ips = {name: f"{self.subnet}.{10 + i}" for i, name in enumerate(members)}
        self._veths = {name: f"kv{tag}h{i}" for i, name in enumerate(members)}
        self._cut: set[frozenset[str]] = set()

    def start(self) -> NetnsLab:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for name, namespace in self.namespaces.items():
            veth = self._veths[name]
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}n")
            _run("ip", "link", "set", f"{veth}n", "netns", namespace)
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            inside = ("ip", "netns", "exec", namespace)
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "link", "set", f"{veth}n", "name", "eth0")
            _run(*inside, "ip", "addr", "add", f"{self.ips[name]}/24", "dev", "eth0")
            _run(*inside, "ip", "link", "set", "eth0", "up")
        return self

    def exec_prefix(self, name: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.namespaces[name])

    def shape(self, name: str, rate: str) -> None:
        """Caps traffic into `name`'s namespace at `rate` (tc tbf, e.g. "100mbit"); replaces
        whatever queue the link had, so it also ends a `blackhole`."""
        self._root_qdisc(name, "tbf", "rate", rate, "burst", "64kb", "latency", "200ms")

    def blackhole(self, name: str) -> None:
        """Drops every packet into `name`'s namespace from now on, mid-connection (a queue of
        length 0 replaces the link's qdisc: 100 % loss without netem, which not every
        kernel has); `shape` or `restore` brings the link back."""
        self._root_qdisc(name, "pfifo", "limit", "0")

    def restore(self, name: str) -> None:
        """Gives `name`'s link back its default queue: unshaped, no longer blackholed."""
        subprocess.run(
            ["tc", "qdisc", "del", "dev", self._veths[name], "root"],
            check=False,
            capture_output=True,
        )

    def sent_bytes(self, name: str) -> int:
        """Bytes the link's current qdisc has passed into `name`'s namespace."""
        shown = subprocess.run(
            ["tc", "-s", "-j", "qdisc", "show", "dev", self._veths[name]],
            check=True,
            capture_output=True,
        )
        return sum(int(q.get("bytes", 0)) for q in json.loads(shown.stdout) if q.get("root"))

    def _root_qdisc(self, name: str, *spec: str) -> None:
        _run("tc", "qdisc", "replace", "dev", self._veths[name], "root", *spec)

    def cut(self, a: str, b: str) -> None:
        """Drops every packet between a and b, both ways, silently (no RST, no ICMP);
        cutting a link already cut changes nothing."""
        if frozenset((a, b)) in self._cut:
            return
        self._rules(a, b, "-A")
        self._cut.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        """Undoes `cut(a, b)` (nothing when the link is not cut)."""
        if frozenset((a, b)) not in self._cut:
            return
        self._rules(a, b, "-D")
        self._cut.discard(frozenset((a, b)))

    def _rules(self, a: str, b: str, action: str) -> None:
        for here, there in ((a, b), (b, a)):
            inside = ("ip", "netns", "exec", self.namespaces[here], "iptables")
            _run(*inside, action, "OUTPUT", "-d", self.ips[there], "-j", "DROP")
            _run(*inside, action, "INPUT", "-s", self.ips[there], "-j", "DROP")

    def stop(self) -> None:
        for name, namespace in self.namespaces.items():
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)
            subprocess.run(
                ["ip", "link", "del", self._veths[name]], check=False, capture_output=True
            )
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)
