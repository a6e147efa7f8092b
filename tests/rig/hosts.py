"""Hosts of the rig: one interface, two ways to reach a host.

:class:`NetnsHost` is a network namespace on this machine (the rig here, in CI);
:class:`SshHost` is a real machine of an Ansible inventory, reached over SSH, on which the
fleet was installed with ``ansible/site.yml`` (daemons are the systemd units). A fault is
a shell command on the host either way, so a scenario is written once.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.rig.net import RigError, sh

# The daemons' systemd units on real hosts (ansible/roles/*/templates).
UNITS = {"agent": "phalanx-agentd", "supervisor": "phalanx-supervisor", "broker": "mosquitto"}


@dataclass
class Host(ABC):
    name: str
    address: str
    iface: str = "eth0"
    rack: str = "rack1"
    roles: list[str] = field(default_factory=list)  # control | gpu | spare

    @abstractmethod
    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The command that runs ``argv`` on this host, from the driver's machine."""

    def run(self, *argv: str, timeout: float = 30.0, check: bool = True) -> str:
        return sh(*self.wrap(argv), timeout=timeout, check=check).stdout

    # --- faults, as commands on the host --------------------------------------------------

    def cut_link(self, seconds: float) -> list[str]:
        """The host's link down for ``seconds``, then up: one command, so that it also
        works over the SSH connection it cuts."""
        return [
            "sh",
            "-c",
            f"ip link set {self.iface} down; sleep {seconds:g}; ip link set {self.iface} up",
        ]

    def slow_link(self, delay_ms: int, loss_pct: float) -> list[str]:
        netem = f"netem delay {delay_ms}ms loss {loss_pct:g}%"
        return f"tc qdisc replace dev {self.iface} root {netem}".split()

    def throttle_link(self, rate_kbit: int, queue_ms: int) -> list[str]:
        """A slow link where the kernel has no netem: its rate capped (tbf), so what
        queues waits up to ``queue_ms`` and the rest is dropped."""
        tbf = f"tbf rate {rate_kbit}kbit burst 16kbit latency {queue_ms}ms"
        return f"tc qdisc replace dev {self.iface} root {tbf}".split()

    def clear_link(self) -> list[str]:
        return ["tc", "qdisc", "del", "dev", self.iface, "root"]

    def block(self, other: str) -> list[str]:
        """Drop this host's traffic to ``other`` (a partition, both hosts blocking)."""
        return ["ip", "route", "replace", "blackhole", f"{other}/32"]

    def unblock(self, other: str) -> list[str]:
        return ["ip", "route", "del", "blackhole", f"{other}/32"]

    def fill(self, path: Path) -> list[str]:
        """Fill the filesystem of ``path`` to the last byte (a real ENOSPC)."""
        ballast = path / ".rig-ballast"
        return ["sh", "-c", f"dd if=/dev/zero of={ballast} bs=1M status=none; sync; true"]

    def unfill(self, path: Path) -> list[str]:
        return ["rm", "-f", str(path / ".rig-ballast")]


@dataclass
class NetnsHost(Host):
    """A namespace on this machine; its daemons are processes the rig started."""

    namespace: str = ""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def start(
        self, role: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                self.wrap(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.processes[role] = proc
        return proc

    def signal(self, role: str, sig: int) -> None:
        proc = self.processes.get(role)
        if proc is None:
            raise RigError(f"host {self.name} runs no {role}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def kill(self, role: str) -> None:
        """SIGKILL the role's process group and reap it (a crash, as the fault)."""
        proc = self.processes.pop(role, None)
        if proc is None:
            raise RigError(f"host {self.name} runs no {role}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class Unreachable(RigError):
    """A host that does not answer over SSH; the message names it."""


# Runs one command on this machine (ssh, ansible-playbook) with ``input`` on its stdin,
# within ``timeout`` seconds; never raises on an exit status. The SSH fleet's I/O boundary:
# the tests put a fake here.
Runner = Callable[[Sequence[str], float, str], "subprocess.CompletedProcess[str]"]


def run_local(
    argv: Sequence[str], timeout: float, input: str = ""
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), input=input, capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RigError(f"{' '.join(argv)}: {exc}") from exc


@dataclass
class SshHost(Host):
    """A real host of an Ansible inventory; the daemons are its systemd units."""

    user: str = "root"
    port: int = 22
    ssh_options: tuple[str, ...] = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
    groups: list[str] = field(default_factory=list)  # the inventory's: brokers, agents, ...
    runner: Runner = field(default=run_local, repr=False, compare=False)

    @property
    def target(self) -> str:
        return f"{self.user}@{self.address}"

    def wrap(self, argv: Sequence[str]) -> list[str]:
        return ["ssh", *self.ssh_options, "-p", str(self.port), self.target, "--", shlex.join(argv)]

    def call(
        self, argv: Sequence[str], *, timeout: float = 30.0, check: bool = True, input: str = ""
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on the host. A host that does not answer (ssh's own exit 255) is
        an error naming it, always; with ``check``, so is the command's failure."""
        done = self.runner(self.wrap(argv), timeout, input)
        if done.returncode == 255:
            why = (done.stderr.strip().splitlines() or ["exit 255"])[-1]
            raise Unreachable(
                f"host {self.name} ({self.target}, port {self.port}) does not answer over "
                f"SSH: {why}"
            )
        if check and done.returncode != 0:
            raise RigError(
                f"{self.name}: {shlex.join(argv)}: exit {done.returncode}: "
                f"{done.stderr.strip()[-400:]}"
            )
        return done

    def run(self, *argv: str, timeout: float = 30.0, check: bool = True) -> str:
        return self.call(argv, timeout=timeout, check=check).stdout

    def fill(self, path: Path) -> list[str]:
        """As :meth:`Host.fill`, but most of it allocated at once (``fallocate``): dd alone
        would take minutes to fill a real disk; dd then writes the rest to the last byte."""
        ballast = shlex.quote(str(path / ".rig-ballast"))
        where = shlex.quote(str(path))
        return [
            "sh",
            "-c",
            f"free=$(( $(stat -f -c '%a * %S' {where}) )); "
            f"fallocate -l $(( free / 100 * 95 )) {ballast} || true; "
            f"dd if=/dev/zero of={ballast} bs=1M oflag=append conv=notrunc status=none; "
            "sync; true",
        ]

    def kill(self, role: str) -> list[str]:
        return ["systemctl", "kill", "--signal=SIGKILL", UNITS[role]]

    def restart(self, role: str) -> list[str]:
        return ["systemctl", "restart", UNITS[role]]


def read_inventory(path: Path) -> list[SshHost]:
    """The hosts of an Ansible INI inventory: ``[brokers]``, ``[supervisors]`` and
    ``[agents]`` groups (directly or through ``[group:children]``), ``name
    ansible_host=ADDR [ansible_user=U] [ansible_port=P] [phalanx_rack=R]
    [phalanx_rig_iface=IF] [ansible_ssh_private_key_file=F] [ansible_ssh_common_args=A]``;
    those variables may also come from ``[group:vars]`` (a host's own win, then its nearest
    group's)."""
    members: dict[str, list[str]] = {}  # group -> its hosts, in order
    children: dict[str, list[str]] = {}  # group -> its child groups
    group_vars: dict[str, dict[str, str]] = {}
    host_vars: dict[str, dict[str, str]] = {}
    group, kind = "", ""
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith(";"):
            continue
        if line.startswith("["):
            group, _, kind = line.strip("[]").partition(":")
            continue
        if not group:
            continue
        if kind == "children":
            children.setdefault(group, []).append(line.split()[0])
            continue
        if kind == "vars":
            k, sep, v = line.partition("=")
            if not sep:
                raise RigError(f"{path}:{n}: expected key=value, got {line!r}")
            v = v.strip()
            if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
                v = v[1:-1]
            group_vars.setdefault(group, {})[k.strip()] = v
            continue
        if kind:
            continue
        name, *pairs = shlex.split(line)
        kv = host_vars.setdefault(name, {})
        for pair in pairs:
            if "=" not in pair:
                raise RigError(f"{path}:{n}: expected key=value, got {pair!r}")
            k, v = pair.split("=", 1)
            kv[k] = v
        if name not in members.setdefault(group, []):
            members[group].append(name)

    def depth(g: str, seen: frozenset[str] = frozenset()) -> int:
        parents = [p for p, kids in children.items() if g in kids and p not in seen]
        return 1 + max((depth(p, seen | {g}) for p in parents), default=0)

    def ancestors(g: str, seen: frozenset[str] = frozenset()) -> list[str]:
        found = [g]
        for parent, kids in children.items():
            if g in kids and parent not in seen:
                found += ancestors(parent, seen | {g})
        return found

    hosts: dict[str, SshHost] = {}
    for g, names in members.items():
        for name in names:
            if name in hosts:
                groups = hosts[name].groups
            else:
                groups = []
                hosts[name] = SshHost(name=name, address=name, groups=groups)
            for a in ancestors(g):
                if a not in groups:
                    groups.append(a)
    for name, host in hosts.items():
        kv: dict[str, str] = dict(group_vars.get("all", {}))
        for g in sorted(host.groups, key=lambda g: (depth(g), g)):  # nearest group last
            kv.update(group_vars.get(g, {}))
        kv.update(host_vars.get(name, {}))
        host.address = kv.get("ansible_host", name)
        host.user = kv.get("ansible_user", "root")
        host.port = int(kv.get("ansible_port", "22"))
        host.rack = kv.get("phalanx_rack", "rack1")
        host.iface = kv.get("phalanx_rig_iface", "eth0")
        key = kv.get("ansible_ssh_private_key_file") or kv.get("ansible_private_key_file")
        more = shlex.split(kv.get("ansible_ssh_common_args", ""))
        host.ssh_options = (*host.ssh_options, *(("-i", key) if key else ()), *more)
        for group, role in (("brokers", "control"), ("supervisors", "control"), ("agents", "gpu")):
            if group in host.groups and role not in host.roles:
                host.roles.append(role)
    return list(hosts.values())
