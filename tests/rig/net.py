"""The rig's network, made of Linux network namespaces: a bridge in the root namespace, one
namespace per host with a veth into the bridge and its own address.

Every name carries the run's id (``phx<rid>``), so two runs never collide, and everything
made is written to the run's state file first, so ``down`` can remove what a crashed run
left. Needs root (``ip netns``, ``ip link``, ``tc``, ``mount``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import random
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

STATE_ROOT = Path(os.environ.get("PHALANX_RIG_DIR", "/tmp/phalanx-rig"))
PREFIX = "phx"  # every interface, bridge and namespace of the rig starts with it


class RigError(RuntimeError):
    """The rig could not be built or torn down; the message says what failed."""


def sh(*cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run one command; a failure raises :class:`RigError` naming it and its stderr."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RigError(f"{' '.join(cmd)}: {exc}") from exc
    if check and done.returncode != 0:
        raise RigError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()[-400:]}")
    return done


def can_build() -> str | None:
    """None when namespaces can be made here; else one line saying why not."""
    if os.geteuid() != 0:
        return "the rig needs root (ip netns, veth, tc, loop mounts)"
    for tool in ("ip", "tc", "mkfs.ext4", "mount", "umount", "losetup"):
        if shutil.which(tool) is None:
            return f"the rig needs {tool} (apt-get install -y iproute2 e2fsprogs mount)"
    probe = f"{PREFIX}probe{os.getpid() % 10000}"
    made = sh("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class RunState:
    """What one run made, written before it is made (the cleanup's source of truth)."""

    rid: str
    subnet: str
    bridge: str
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)

    @property
    def dir(self) -> Path:
        return STATE_ROOT / self.rid

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "rig.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, self.dir / "rig.json")

    @classmethod
    def load(cls, directory: Path) -> RunState:
        return cls(**json.loads((directory / "rig.json").read_text()))


def _free_subnet() -> ipaddress.IPv4Network:
    used = sh("ip", "-4", "route", "show", "table", "all", check=False).stdout
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{random.randint(64, 250)}.{random.randint(0, 255)}.0/24")
        if str(net.network_address).rsplit(".", 1)[0] + "." not in used:
            return net
    raise RigError("no free 10.x.y.0/24 subnet for the rig's bridge")


class Network:
    """The bridge and the hosts' namespaces of one run."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.subnet = ipaddress.ip_network(state.subnet)

    @classmethod
    def create(cls) -> Network:
        rid = f"{random.randrange(16**4):04x}"
        net = _free_subnet()
        state = RunState(rid=rid, subnet=str(net), bridge=f"{PREFIX}{rid}br")
        state.save()
        self = cls(state)
        state.links.append(state.bridge)
        state.save()
        sh("ip", "link", "add", state.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.root_address}/24", "dev", state.bridge)
        sh("ip", "link", "set", state.bridge, "up")
        return self

    @property
    def root_address(self) -> str:
        """The root namespace's address on the bridge: the driver's view of the hosts."""
        return str(self.subnet.network_address + 254)

    def address(self, index: int) -> str:
        return str(self.subnet.network_address + 1 + index)

    def namespace(self, index: int) -> str:
        return f"{PREFIX}{self.state.rid}-h{index}"

    def veth(self, index: int) -> str:
        """The host's veth end in the root namespace (the bridge port); ``eth0`` inside."""
        return f"{PREFIX}{self.state.rid}h{index}"

    def add_host(self, index: int) -> str:
        ns, outside = self.namespace(index), self.veth(index)
        self.state.namespaces.append(ns)
        self.state.links.append(outside)
        self.state.save()
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", outside, "type", "veth", "peer", "name", f"{outside}i")
        sh("ip", "link", "set", f"{outside}i", "netns", ns)
        sh("ip", "link", "set", outside, "master", self.state.bridge, "up")
        inside = ("ip", "netns", "exec", ns, "ip")
        sh(*inside, "link", "set", f"{outside}i", "name", "eth0")
        sh(*inside, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
        sh(*inside, "link", "set", "eth0", "up")
        sh(*inside, "link", "set", "lo", "up")
        return ns


def teardown(state: RunState) -> list[str]:
    """Remove what the run made, whatever state it is in; the problems met (never raises)."""
    problems: list[str] = []
    for pid in state.pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, 9)
    for ns in state.namespaces:  # anything still running in a namespace goes with it
        pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
    for mount in reversed(state.mounts):
        if os.path.ismount(mount):
            done = sh("umount", "-l", mount, check=False)
            if done.returncode != 0:
                problems.append(f"umount {mount}: {done.stderr.strip()}")
    for ns in state.namespaces:
        sh("ip", "netns", "del", ns, check=False)
    for link in reversed(state.links):
        sh("ip", "link", "del", link, check=False)
    shutil.rmtree(state.dir, ignore_errors=True)
    return problems


def leftovers() -> list[RunState]:
    """Runs whose state is still on disk (a crashed or running rig)."""
    if not STATE_ROOT.is_dir():
        return []
    out = []
    for d in sorted(STATE_ROOT.iterdir()):
        try:
            out.append(RunState.load(d))
        except (OSError, ValueError, TypeError):
            out.append(RunState(rid=d.name, subnet="0.0.0.0/24", bridge=f"{PREFIX}{d.name}br"))
    return out


def stray_names() -> list[str]:
    """Rig namespaces and links that no state file names (e.g. a state dir removed by hand)."""
    names = sh("ip", "netns", "list", check=False).stdout.split("\n")
    links = sh("ip", "-o", "link", "show", check=False).stdout.split("\n")
    found = [n.split()[0] for n in names if n.startswith(PREFIX)]
    for line in links:
        m = re.match(r"\d+: (phx[0-9a-f]{4}(?:br|h\d+))[@:]", line)
        if m:
            found.append(m.group(1))
    return found
