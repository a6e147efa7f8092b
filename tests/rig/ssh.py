"""The rig's fleet on real machines: the hosts of an Ansible inventory, reached over SSH as
a user who may run ``systemctl``, ``ip`` and ``tc`` (root), on which ``ansible/site.yml``
installed the fleet.

Nothing is guessed: where the agent keeps its data, its simulated GPUs' file, its RAM
tier and its object tier, which user it runs as and which interpreter runs its ranks are
read from each host's ``phalanx-agentd`` unit and the ``agentd.toml`` that unit names; the
supervisor's API address and token from its ``supervisor.toml`` (the API listens on
loopback, so the rig reaches it through an SSH tunnel). The daemons are the systemd units
(``hosts.UNITS``): a crash is ``systemctl kill --signal=SIGKILL``, the way back
``systemctl restart``.

The fleet is not rebuilt for each scenario as the namespace fleet is: :meth:`SshFleet.scenario`
puts it back in order instead (no disk ballast, healthy simulated GPUs, every agent node
up and undrained).
"""

from __future__ import annotations

import contextlib
import logging
import re
import shlex
import socket
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

from phalanx.client import ApiError, Client
from tests.rig import shards
from tests.rig.base import SIM_GPU_FAULTS, Fleet, Unsupported
from tests.rig.hosts import UNITS, Host, Runner, SshHost, Unreachable, read_inventory, run_local
from tests.rig.net import RigError

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
# Where the job's script is put on every agent host: readable by the agent's ranks under
# the unit's ProtectSystem=strict, PrivateTmp and ProtectHome=read-only.
RIG_DIR = PurePosixPath("/opt/phalanx-rig")
# "For good", for a scenario: longer than the driver's JOB_TIMEOUT_S, then the link comes
# back by itself (a real host cut for good would need its console).
PEER_GONE_S = 330
NODES_UP_S = 400.0  # a scenario waits this long for every agent node to be up again
# One SSH connection per host, shared by every command (a rank killed the moment a step
# lands on NVMe cannot wait for a new connection); a connection that stops answering
# (a link cut) is given up after 30 s.
MUX_OPTIONS = (
    *("-o", "ControlMaster=auto", "-o", "ControlPath=/tmp/phalanx-rig-ssh-%C"),
    *("-o", "ControlPersist=120", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=6"),
)
LOOPBACK = ("127.0.0.1", "localhost", "::1")

# Run as the agent's user with the agent's interpreter, so the file stays the agent's.
SIM_INJECT = (
    "import sys; from pathlib import Path; from agentd.gpu.sim import inject; "
    "inject(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3])"
)
SIM_CLEAR = (
    "import sys; from pathlib import Path; from agentd.gpu.sim import inject, read_state; "
    "p = Path(sys.argv[1]); [inject(p, int(g['index']), 'clear') for g in read_state(p)['gpus']]"
)
# sh -c KILL_RANK sh JOB RANK GENERATION: SIGKILL the rank's live process, found by the
# environment the agent gave it; prints its pid, or exits 3.
KILL_RANK = """\
for p in $(pgrep -f examples/tinylm.py); do
  e=$(tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null) || continue
  printf '%s\\n' "$e" | grep -qxF "PHALANX_JOB_ID=$1" || continue
  printf '%s\\n' "$e" | grep -qxF "RANK=$2" || continue
  printf '%s\\n' "$e" | grep -qxF "PHALANX_GENERATION=$3" || continue
  kill -KILL "$p" && echo "$p" && exit 0
done
exit 3
"""


@dataclass
class Agent:
    """An agent host as its unit and its agentd.toml lay it out."""

    node_id: str
    user: str
    python: str  # the agent's interpreter: it runs the ranks too
    config: PurePosixPath
    data_dir: PurePosixPath
    backend: str
    sim_file: PurePosixPath
    shm_dir: PurePosixPath
    object_store: str
    address: str
    data_fs: str = ""  # the mount point of the data directory's filesystem

    @classmethod
    def parse(cls, host: str, unit: dict[str, str], config: PurePosixPath, text: str) -> Agent:
        try:
            conf = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RigError(f"host {host}: {config}: {exc}") from exc
        argv = _exec_argv(unit.get("ExecStart", ""))
        data_dir = PurePosixPath(conf.get("data_dir", "/var/lib/phalanx"))
        gpu, ckpt = conf.get("gpu", {}), conf.get("ckpt", {})
        return cls(
            node_id=str(conf.get("node_id") or host.split(".")[0]),
            user=unit.get("User") or "root",
            python=str(PurePosixPath(argv[0]).parent / "python") if argv else "python3",
            config=config,
            data_dir=data_dir,
            backend=str(gpu.get("backend", "auto")),
            sim_file=PurePosixPath(gpu.get("sim_file") or data_dir / "sim-gpus.json"),
            shm_dir=PurePosixPath(ckpt.get("shm_dir", "/dev/shm")),
            object_store=str(ckpt.get("object_store", "")),
            address=str(conf.get("address", "")),
        )

    @property
    def nvme(self) -> PurePosixPath:
        return self.data_dir / "ckpt"


class SshFleet(Fleet):
    """``SshFleet.from_inventory(path)``; use it as a context manager (it holds the API's
    SSH tunnel) and open each scenario with :meth:`scenario`."""

    def __init__(
        self,
        hosts: list[SshHost],
        agents: dict[str, Agent],
        api: str,
        token: str,
        object_store_unit: tuple[str, str] | None = None,
        tunnel: subprocess.Popen[bytes] | None = None,
        ca_file: Path | None = None,
    ) -> None:
        self.hosts: list[SshHost] = hosts
        self.agents = agents
        self.api = api
        self.token = token
        self.object_store_unit = object_store_unit
        self.tunnel = tunnel
        self.ca_file = ca_file  # the CA of an https:// API's certificate
        self._ca_dir: tempfile.TemporaryDirectory[str] | None = None

    # --- building --------------------------------------------------------------------------

    @classmethod
    def from_inventory(
        cls,
        path: Path,
        *,
        converge: bool = False,
        ansible_args: Sequence[str] = (),
        api: str | None = None,
        token: str | None = None,
        ca_file: Path | None = None,
        object_store_unit: tuple[str, str] | None = None,
        runner: Runner = run_local,
    ) -> SshFleet:
        """The fleet of an Ansible INI inventory. ``converge``: first run
        ``ansible-playbook -i PATH ansible/site.yml`` (with ``ansible_args``, e.g. a vault
        password file). Every host must answer over SSH; ``api`` and ``token`` default to
        what the supervisor's configuration says (through a tunnel when it listens on
        loopback). An API that serves HTTPS (``[api] tls_cert_file``) is called at https://,
        verified against ``ca_file``, by default the supervisor's ``agent_ca_file`` (the
        roles issue the API's and the agents' certificates from that CA) copied from its
        host. ``object_store_unit``: (host, systemd unit) of the object store that
        object-store-down freezes. ``runner`` runs every command (ssh, ansible-playbook)."""
        hosts = read_inventory(path)
        for h in hosts:
            h.runner = runner
            h.ssh_options = (*h.ssh_options, *MUX_OPTIONS)
        if converge:
            _converge(path, ansible_args, runner)
        for h in hosts:
            h.call(["true"], timeout=30)  # a host that does not answer: one line naming it
        agents: dict[str, Agent] = {}
        for h in hosts:
            if "agents" in h.groups:
                agent = _read_agent(h)
                h.name = agent.node_id  # the fleet names hosts as the supervisor names nodes
                agents[h.name] = agent
        fleet = cls(hosts, agents, api or "", token or "", object_store_unit, ca_file=ca_file)
        if not agents:
            raise RigError(f"{path}: no host in [agents]")
        fleet.daemon_host("broker")
        sup = fleet.daemon_host("supervisor")
        if object_store_unit is not None:
            fleet.host(object_store_unit[0])
        fleet.job_runtime()  # one interpreter on every agent host
        for h in fleet.gpu_hosts:
            _install_job(h, fleet.agents[h.name])
        https = (api or "").startswith("https://")
        conf = _read_supervisor(sup) if api is None or token is None or https else {}
        api_conf = conf.get("api", {})
        tls = https if api is not None else bool(api_conf.get("tls_cert_file"))
        if tls and ca_file is None:
            fleet.fetch_ca(sup, conf)
        if api is None or token is None:
            if token is None:
                token_file = api_conf.get("token_file", "/etc/phalanx/api-token")
                fleet.token = sup.run("cat", str(token_file)).strip()
            if api is None:
                bind, port = str(api_conf.get("host", "127.0.0.1")), int(api_conf.get("port", 8740))
                scheme = "https" if tls else "http"
                if bind in LOOPBACK:  # the roles' API certificate names 127.0.0.1
                    fleet.tunnel, fleet.api = open_tunnel(sup, port, scheme=scheme)
                else:
                    where = sup.address if bind in ("0.0.0.0", "::", "") else bind
                    fleet.api = f"{scheme}://{where}:{port}"
        return fleet

    def __enter__(self) -> SshFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fetch_ca(self, sup: SshHost, conf: dict[str, Any]) -> None:
        """The CA an https:// API is verified against: the supervisor's ``agent_ca_file``,
        copied here into a folder of the fleet's own (gone at :meth:`close`)."""
        where = conf.get("agent_ca_file")
        if not where:
            raise RigError(
                f"host {sup.name}: the supervisor's API serves HTTPS but its configuration "
                "names no agent_ca_file to verify it with: pass the CA (--ca FILE)"
            )
        pem = sup.run("cat", str(where))
        if "BEGIN CERTIFICATE" not in pem:
            raise RigError(f"host {sup.name}: {where} holds no PEM certificate")
        self._ca_dir = tempfile.TemporaryDirectory(prefix="phalanx-rig-ca-")
        self.ca_file = Path(self._ca_dir.name) / "ca.pem"
        self.ca_file.write_text(pem)

    def close(self) -> None:
        if self.tunnel is not None and self.tunnel.poll() is None:
            self.tunnel.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.tunnel.wait(5)
        self.tunnel = None
        if self._ca_dir is not None:
            self._ca_dir.cleanup()
            self._ca_dir = None

    @contextlib.contextmanager
    def scenario(self) -> Iterator[SshFleet]:
        """The fleet, put back in order for the next scenario: what a scenario that was
        interrupted left (a disk ballast, a sim-GPU fault) removed, every agent node up."""
        deadline = time.monotonic() + NODES_UP_S
        untidy: dict[str, str] = {h.name: "" for h in self.gpu_hosts}
        while untidy:
            for name in sorted(untidy):
                try:
                    self._tidy(self.host(name))
                    del untidy[name]
                except Unreachable as exc:  # still cut off (peer-gone): again in a while
                    untidy[name] = str(exc)
            if untidy and time.monotonic() > deadline:
                raise RigError("; ".join(untidy.values()))
            if untidy:
                time.sleep(5)
        self.wait_agents_up(max(30.0, deadline - time.monotonic()))
        yield self

    def _tidy(self, host: SshHost) -> None:
        self.unfill_disk(host)
        agent = self.agents[host.name]
        if agent.backend == "sim":
            self._as_agent(host, "-c", SIM_CLEAR, str(agent.sim_file))

    def wait_agents_up(self, timeout: float) -> None:
        """Undrain what a fault drained (a GPU fault, a quarantine) until every agent node
        is up (a node that warns gets no new work); a node that an XID still holds is
        drained again, so retry."""
        deadline, states = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            try:
                nodes = {n["id"]: n for n in self.client().get("/v1/nodes")}
            except (ApiError, OSError):
                time.sleep(2)
                continue
            states = {n: nodes.get(n, {}).get("state") for n in self.agents}
            if all(s == "up" for s in states.values()):
                return
            for node, state in states.items():
                if state == "drain":
                    with contextlib.suppress(ApiError, OSError):
                        self.client().post(f"/v1/nodes/{node}/undrain", {"force": True})
            time.sleep(2)
        raise RigError(f"the agent nodes were not all up within {timeout:.0f} s: {states}")

    # --- the hosts -------------------------------------------------------------------------

    @property
    def gpu_hosts(self) -> list[SshHost]:
        return [h for h in self.hosts if h.name in self.agents]

    def daemon_host(self, role: str) -> SshHost:
        group = {"broker": "brokers", "supervisor": "supervisors"}[role]
        for h in self.hosts:
            if group in h.groups:
                return h
        raise RigError(f"the inventory has no host in [{group}]")

    def data_address(self, host: Host) -> str:
        """The address the node announced (its agent's), else its agentd.toml's, else the
        one SSH reaches it at."""
        with contextlib.suppress(ApiError, OSError):
            node = self.client().get(f"/v1/nodes/{host.name}")
            if node.get("address"):
                return str(node["address"])
        agent = self.agents.get(host.name)
        return (agent.address if agent else "") or host.address

    def client(self) -> Client:
        return Client(self.api, self.token, ca_file=self.ca_file)

    def cannot(self, kind: str) -> str | None:
        if kind in SIM_GPU_FAULTS:
            real = sorted(n for n, a in self.agents.items() if a.backend != "sim")
            if real:
                return (
                    f"{kind} edits the simulated GPUs: every agent needs the sim backend "
                    f'([gpu] backend = "sim"; phalanx_agent_gpu_backend: sim), and '
                    f"{', '.join(real)} run {self.agents[real[0]].backend}"
                )
        agents = self.agents.values()
        if kind == "object-store-down" and self.object_store_unit is None:
            return (
                "object-store-down freezes the object store's process: name its host and "
                "systemd unit (--object-store-unit HOST:UNIT); the agents' object tier is "
                + ", ".join(sorted({a.object_store or "DATA_DIR/ckpt-objects" for a in agents}))
            )
        if kind == "disk-full":
            on_root = sorted(n for n, a in self.agents.items() if a.data_fs == "/")
            if on_root:
                return (
                    f"disk-full fills the NVMe tier's filesystem, and on {', '.join(on_root)} "
                    "that is / (give the agent's data directory a filesystem of its own)"
                )
        return None

    # --- the job ---------------------------------------------------------------------------

    def job_runtime(self) -> dict[str, str]:
        pythons = {a.python for a in self.agents.values()}
        if len(pythons) != 1:
            raise RigError(
                "the job's command names one interpreter for every rank, and the agents' "
                f"units run {', '.join(sorted(pythons))}"
            )
        return {"python": pythons.pop(), "workdir": str(RIG_DIR)}

    def rank_log(self, job: dict[str, Any], rank: int) -> str:
        node = next(r["node"] for r in job["ranks"] if r["rank"] == rank)
        host, agent = self.host(node), self.agents[node]
        path = agent.data_dir / "jobs" / job["id"] / f"g{job['generation']}" / f"rank-{rank}.log"
        done = host.call(["cat", str(path)], check=False)
        if done.returncode != 0:
            raise FileNotFoundError(f"{node}:{path}: {done.stderr.strip()}")
        return done.stdout

    def kill_rank(self, host: Host, job_id: str, rank: int, generation: int) -> None:
        h = self.host(host.name)
        done = h.call(
            ["sh", "-c", KILL_RANK, "sh", job_id, str(rank), str(generation)], check=False
        )
        if done.returncode != 0:
            raise RigError(f"rank {rank} of {job_id} is not running on {host.name}")

    def object_shards(self, job_id: str, step: int) -> set[str]:
        """From the object tier the agents are configured with: an S3 bucket (listed with
        this machine's AWS_* environment), or folders (a shared one, or each node's own
        DATA_DIR/ckpt-objects) listed on every agent host that answers."""
        found: set[str] = set()
        for name, agent in self.agents.items():
            store = agent.object_store
            if store.startswith("s3://"):
                return found | _s3_shards(store, job_id, step)
            root = store.removeprefix("file://") if store else str(agent.data_dir / "ckpt-objects")
            folder = PurePosixPath(root) / job_id / f"{step:012d}"
            try:
                done = self.host(name).call(["ls", "-1", str(folder)], check=False)
            except RigError as exc:  # a node cut off: its own folder is out of reach
                log.info("object tier of %s: %s", name, exc)
                continue
            if done.returncode == 0:
                found |= {line.split(".")[0] for line in done.stdout.split()}
        return found

    # --- daemons ---------------------------------------------------------------------------

    def kill(self, host: Host, role: str) -> None:
        h = self.host(host.name)
        h.run(*h.kill(role))

    def restart(self, host: Host, role: str) -> None:
        h = self.host(host.name)
        h.run(*h.restart(role), timeout=150)  # Type=notify: returns once it serves

    def _object_store(self, sig: str) -> None:
        if self.object_store_unit is None:
            raise Unsupported(self.cannot("object-store-down") or "no object store unit")
        name, unit = self.object_store_unit
        self.host(name).run("systemctl", "kill", f"--signal={sig}", unit)

    def stop_object_store(self) -> None:
        self._object_store("SIGSTOP")

    def continue_object_store(self) -> None:
        self._object_store("SIGCONT")

    # --- GPUs, disks, files, links ---------------------------------------------------------

    def _as_agent(self, host: Host, *argv: str, timeout: float = 30.0) -> str:
        """The agent's interpreter, as the agent's user (its files stay the agent's)."""
        agent = self.agents[host.name]
        h = self.host(host.name)
        return h.run("runuser", "-u", agent.user, "--", agent.python, *argv, timeout=timeout)

    def inject_gpu(self, host: Host, gpu: int, fault: str) -> None:
        agent = self.agents[host.name]
        if agent.backend != "sim":
            raise Unsupported(
                f"a sim-GPU fault needs the sim backend; {host.name} runs {agent.backend}"
            )
        self._as_agent(host, "-c", SIM_INJECT, str(agent.sim_file), str(gpu), fault)

    def nvme(self, host: Host) -> PurePosixPath:
        return self.agents[host.name].nvme

    def fill_disk(self, host: Host) -> int:
        if self.agents[host.name].data_fs == "/":
            raise Unsupported(self.cannot("disk-full") or "the NVMe tier is on /")
        h, nvme = self.host(host.name), self.nvme(host)
        h.run(*h.fill(Path(nvme)), timeout=600)
        free, size = h.run("stat", "-f", "-c", "%a %S", str(nvme)).split()
        return int(free) * int(size)

    def unfill_disk(self, host: Host) -> None:
        h = self.host(host.name)
        h.run(*h.unfill(Path(self.nvme(host))), check=False)

    def wait_new_step(self, host: Host, job_id: str, timeout: float) -> str | None:
        folder = str(self.nvme(host) / job_id)
        out = self._python(host, "newstep", folder, f"{timeout:g}", timeout=timeout + 30)
        return out.strip() or None

    def newest_slot(self, host: Host, job_id: str, rank: int) -> tuple[PurePath, int, int]:
        shm = str(self.agents[host.name].shm_dir)
        h = self.host(host.name)
        argv = [self.agents[host.name].python, "-c", shards.REMOTE, "slot", shm, job_id, str(rank)]
        done = h.call(argv, check=False)
        if done.returncode == 3:
            raise RigError(f"no sealed RAM slot of rank {rank} of {job_id} in {host.name}:{shm}")
        if done.returncode != 0:
            raise RigError(f"{host.name}: reading the RAM slots: {done.stderr.strip()[-400:]}")
        path, step, nbytes = done.stdout.split()
        return PurePosixPath(path), int(step), int(nbytes)

    def file_size(self, host: Host, path: PurePath) -> int | None:
        done = self.host(host.name).call(["stat", "-c", "%s", str(path)], check=False)
        return int(done.stdout) if done.returncode == 0 else None

    def flip(self, host: Host, path: PurePath, start: int, nbytes: int) -> None:
        self._python(host, "flip", str(path), str(start + nbytes // 2))

    def _python(self, host: Host, *args: str, timeout: float = 30.0) -> str:
        py = self.agents[host.name].python
        return self.host(host.name).run(py, "-c", shards.REMOTE, *args, timeout=timeout)

    def cut_link_for_good(self, host: Host) -> None:
        """Down for PEER_GONE_S, detached from the SSH session it cuts."""
        cut = f"ip link set {host.iface} down; sleep {PEER_GONE_S}; ip link set {host.iface} up"
        detached = f"setsid -f sh -c {shlex.quote(cut)} </dev/null >/dev/null 2>&1"
        self.host(host.name).run("sh", "-c", detached)


def _exec_argv(exec_start: str) -> list[str]:
    """The argv of systemctl show's ``ExecStart={ path=... ; argv[]=... ; ... }``."""
    m = re.search(r"argv\[\]=([^;]*)", exec_start)
    return shlex.split(m.group(1)) if m else []


def _unit(host: SshHost, unit: str) -> dict[str, str]:
    out = host.run(
        "systemctl", "show", unit, "--property=LoadState", "--property=User", "--property=ExecStart"
    )
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if props.get("LoadState") != "loaded":
        raise RigError(
            f"host {host.name} has no {unit} unit (LoadState {props.get('LoadState')}): install "
            "the fleet with ansible/site.yml (or run with --converge)"
        )
    return props


def _config_path(props: dict[str, str], default: str) -> PurePosixPath:
    argv = _exec_argv(props.get("ExecStart", ""))
    if "--config" in argv[:-1]:
        return PurePosixPath(argv[argv.index("--config") + 1])
    return PurePosixPath(default)


def _read_agent(host: SshHost) -> Agent:
    props = _unit(host, UNITS["agent"])
    config = _config_path(props, "/etc/phalanx/agentd.toml")
    agent = Agent.parse(host.name, props, config, host.run("cat", str(config)))
    df = host.run("df", "--output=target", str(agent.data_dir)).split()
    agent.data_fs = df[-1] if df else ""
    return agent


def _read_supervisor(host: SshHost) -> dict[str, Any]:
    props = _unit(host, UNITS["supervisor"])
    config = _config_path(props, "/etc/phalanx/supervisor.toml")
    try:
        return tomllib.loads(host.run("cat", str(config)))
    except tomllib.TOMLDecodeError as exc:
        raise RigError(f"host {host.name}: {config}: {exc}") from exc


def _install_job(host: SshHost, agent: Agent) -> None:
    """The job's script where the ranks can read it, and an interpreter that runs it."""
    done = host.call([agent.python, "-c", "import torch, phalanx.rank"], check=False)
    if done.returncode != 0:
        raise RigError(
            f"host {host.name}: the agent's interpreter {agent.python} cannot run the rig's job "
            "(it needs torch: install the wheel with its train extra, "
            f"phalanx_agent_pip_extras: [train]): {done.stderr.strip()[-200:]}"
        )
    script = RIG_DIR / "examples" / "tinylm.py"
    put = f"mkdir -p {script.parent} && cat > {script}.tmp && mv {script}.tmp {script}"
    host.call(["sh", "-c", put], input=(REPO / "examples" / "tinylm.py").read_text())


def _converge(inventory: Path, extra: Sequence[str], runner: Runner) -> None:
    argv = [
        "ansible-playbook",
        "-i",
        str(inventory.resolve()),
        *extra,
        str(REPO / "ansible" / "site.yml"),
    ]
    done = runner(argv, 3600.0, "")
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        raise RigError(f"{shlex.join(argv)}: exit {done.returncode}: " + " | ".join(tail))


def tunnel_argv(host: SshHost, local_port: int, remote_port: int) -> list[str]:
    """``ssh -N -L``: this machine's 127.0.0.1:local_port to the host's loopback port (a
    connection of its own, not the shared one: options given first win)."""
    return [
        "ssh",
        *("-o", "ControlMaster=no", "-o", "ControlPath=none", "-o", "ExitOnForwardFailure=yes"),
        *host.ssh_options,
        *("-p", str(host.port), "-N", "-L", f"127.0.0.1:{local_port}:127.0.0.1:{remote_port}"),
        host.target,
    ]


def open_tunnel(
    host: SshHost, remote_port: int, *, scheme: str = "http"
) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local = int(s.getsockname()[1])
    proc = subprocess.Popen(
        tunnel_argv(host, local, remote_port),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise RigError(f"the tunnel to {host.name}'s API (port {remote_port}) failed: {err}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", local)) == 0:
                return proc, f"{scheme}://127.0.0.1:{local}"
        time.sleep(0.2)
    proc.terminate()
    raise RigError(f"the tunnel to {host.name}'s API (port {remote_port}): not up within 20 s")


def _s3_shards(store: str, job_id: str, step: int) -> set[str]:
    import boto3

    bucket, _, prefix = store.removeprefix("s3://").partition("/")
    key = f"{prefix.strip('/')}/{job_id}/{step:012d}/".lstrip("/")
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix=key).get("Contents", [])
    return {o["Key"].rsplit("/", 1)[1].split(".")[0] for o in listed}
