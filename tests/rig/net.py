"""The rig's network, made of Linux network namespaces: a bridge in the root namespace, one
namespace per host with a veth into the bridge and its own address.

Every name carries the run's id (``phx<rid>``), and a run claims its id and its subnet
under one lock (:data:`CLAIM_LOCK`), so runs side by side (``pytest -m rig -n 2``, or two
checkouts) never collide. Everything made is written to the run's state file first, with
the process that made it (the owner), so ``down`` can remove what a crashed run left and
never touches a run whose owner still runs. Needs root (``ip netns``, ``ip link``, ``tc``,
``mount``).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import random
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

STATE_ROOT = Path(os.environ.get("PHALANX_RIG_DIR", "/tmp/phalanx-rig"))
# Held while a run claims its id and subnet and makes its bridge: beside STATE_ROOT, whose
# every entry is a run.
CLAIM_LOCK = STATE_ROOT.with_name(STATE_ROOT.name + ".lock")
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
    probe = f"{PREFIX}probe{os.getpid()}"
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
    # The process that made the run and removes it, and its start time (0, "": a state
    # written by a rig older than these fields).
    owner: int = 0
    owner_started: str = ""

    @property
    def dir(self) -> Path:
        return STATE_ROOT / self.rid

    def owner_alive(self) -> bool | None:
        """Whether the run's owner still runs (the run is live: only it removes the run);
        None when the state does not name its owner."""
        if not self.owner:
            return None
        return process_started(self.owner) == self.owner_started

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "rig.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, self.dir / "rig.json")

    @classmethod
    def load(cls, directory: Path) -> RunState:
        return cls(**json.loads((directory / "rig.json").read_text()))


def process_started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat``), or None
    when there is none, or only its zombie (a killed pytest-xdist worker, not yet reaped by
    its controller): with the pid, it names one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # from field 3, the state, after "pid (comm)"
    return None if fields[0] in ("Z", "X") else fields[19]  # field 22: the start time


@contextlib.contextmanager
def locked(path: Path, timeout: float) -> Iterator[None]:
    """An exclusive flock on ``path`` (made if missing), held for the block; a RigError
    naming it when another process holds it for longer than ``timeout`` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RigError(f"{path} not free within {timeout:.0f} s") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def claim_lock(timeout: float = 30.0) -> contextlib.AbstractContextManager[None]:
    """:data:`CLAIM_LOCK`, held: no other run claims an id or a subnet meanwhile."""
    return locked(CLAIM_LOCK, timeout)


def free_subnet(routes: str, claimed: set[str], rng: random.Random) -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no route of this machine (``ip route show table all``) and no
    run's state (``claimed``) has."""
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{rng.randint(64, 250)}.{rng.randint(0, 255)}.0/24")
        prefix = str(net.network_address).rsplit(".", 1)[0] + "."
        if prefix not in routes and str(net) not in claimed:
            return net
    raise RigError("no free 10.x.y.0/24 subnet for the rig's bridge")


def claim_run(rng: random.Random | None = None) -> RunState:
    """A new run's state, saved, with an id and a subnet no other run has (its own, its
    owner this process). Hold :func:`claim_lock` until its bridge has its address."""
    rng = rng or random.Random()
    routes = sh("ip", "-4", "route", "show", "table", "all", check=False).stdout
    runs = leftovers()
    net = free_subnet(routes, {r.subnet for r in runs}, rng)
    taken = {r.rid for r in runs} | {name[len(PREFIX) :][:4] for name in rig_names()}
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    for _ in range(200):
        rid = f"{rng.randrange(16**4):04x}"
        if rid in taken:
            continue
        try:
            (STATE_ROOT / rid).mkdir()  # exclusive: a rig that takes no lock cannot race it
        except FileExistsError:
            continue
        pid = os.getpid()
        state = RunState(
            rid=rid,
            subnet=str(net),
            bridge=f"{PREFIX}{rid}br",
            owner=pid,
            owner_started=process_started(pid) or "",
        )
        state.save()
        return state
    raise RigError(f"no free run id in {STATE_ROOT}")


class Network:
    """The bridge and the hosts' namespaces of one run."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.subnet = ipaddress.ip_network(state.subnet)

    @classmethod
    def create(cls) -> Network:
        # The bridge's address is a route: from then on, any rig sees the subnet taken.
        with claim_lock():
            state = claim_run()
            self = cls(state)
            state.links.append(state.bridge)
            state.save()
            try:
                sh("ip", "link", "add", state.bridge, "type", "bridge")
                sh("ip", "addr", "add", f"{self.root_address}/24", "dev", state.bridge)
                sh("ip", "link", "set", state.bridge, "up")
            except BaseException:
                teardown(state)
                raise
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
    """Runs whose state is still on disk (a crashed or running rig: ``owner_alive``)."""
    if not STATE_ROOT.is_dir():
        return []
    out = []
    for d in sorted(STATE_ROOT.iterdir()):
        if not d.is_dir():
            continue
        try:
            out.append(RunState.load(d))
        except (OSError, ValueError, TypeError):
            out.append(RunState(rid=d.name, subnet="0.0.0.0/24", bridge=f"{PREFIX}{d.name}br"))
    return out


def rig_names() -> list[str]:
    """The rig's namespaces and links on this machine (``phx...``); those that no state
    file names are strays (e.g. a state dir removed by hand)."""
    names = sh("ip", "netns", "list", check=False).stdout.split("\n")
    links = sh("ip", "-o", "link", "show", check=False).stdout.split("\n")
    found = [n.split()[0] for n in names if n.startswith(PREFIX)]
    for line in links:
        m = re.match(r"\d+: (phx[0-9a-f]{4}(?:br|h\d+))[@:]", line)
        if m:
            found.append(m.group(1))
    return found
