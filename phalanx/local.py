"""The local fleet: a broker, the supervisor and N simulated-GPU agents on one machine,
or one agent on this machine's real GPUs (``gpu_backend="nvml"``).

``phalanx local up`` starts them as detached processes under one directory::

    DIR/fleet.json          what was started (pids, ports, roles, the API token; mode
                            0600), read by the other verbs
    DIR/token               the API token (mode 0600)
    DIR/broker/             mosquitto.conf
    DIR/supervisor/         supervisor.toml, its state, and agent-secret: the fleet
                            agent secret (mode 0600) every agent's token derives from
    DIR/nodes/NODE/         agentd.toml, the sim GPU file (none on real GPUs), the
                            agent's data dir, and agent-token: that node's own token
                            (mode 0600)
    DIR/logs/ROLE.log       every process's output
    DIR/objects/            the checkpoint object store every agent shares (a folder)
    DIR/tls/                with ``--tls``: a throw-away CA (ca.pem, exported as
                            PHALANX_CA by ``phalanx local env``) and the certificates
                            of the supervisor's API and of every agent's HTTP

It is what the README's demo runs and what the integration tests build on. Its broker
listens on 127.0.0.1 without users or an ACL (anonymous): any local user can publish as
any node. The broker the Ansible roles install has a user per node and an ACL that
keeps each to its own topics.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.agent_tokens import new_secret, node_token
from phalanx.client import ApiError, Client

if TYPE_CHECKING:
    from phalanx.certs import Authority, Issued

DEFAULT_DIR = Path(os.environ.get("PHALANX_LOCAL_DIR", ".phalanx-local"))


class LocalFleetError(RuntimeError):
    """The local fleet could not be started, found or stopped; the message says why."""


@dataclass
class Proc:
    role: str  # broker | supervisor | agent
    pid: int
    log: str
    node: str | None = None

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A zombie (exited, not yet reaped by us) is not alive.
        try:
            with open(f"/proc/{self.pid}/stat") as fh:
                return fh.read().split(") ", 1)[1][0] != "Z"
        except OSError:
            return True


@dataclass
class Fleet:
    dir: str
    api: str
    token: str
    broker_port: int
    processes: list[Proc]
    ca: str = ""  # the CA of the fleet's HTTPS (``--tls``); empty: plain HTTP
    gpu_backend: str = "sim"  # "sim", or "nvml": one agent on this machine's real GPUs

    @property
    def path(self) -> Path:
        return Path(self.dir)

    def save(self) -> None:
        """Write fleet.json (it holds the API token: mode 0600, as the token file)."""
        data = asdict(self)
        tmp = self.path / "fleet.json.tmp"
        tmp.unlink(missing_ok=True)  # a leftover keeps its mode through os.open
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(data, indent=1))
        os.replace(tmp, self.path / "fleet.json")

    @classmethod
    def load(cls, directory: Path) -> Fleet:
        path = directory / "fleet.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise LocalFleetError(
                f"no local fleet in {directory} (no fleet.json); start one with `phalanx local up`"
            ) from None
        except ValueError as exc:
            raise LocalFleetError(f"{path} is corrupt: {exc}") from exc
        data["processes"] = [Proc(**p) for p in data["processes"]]
        return cls(**data)

    def client(self) -> Client:
        return Client(self.api, self.token, timeout=5.0, ca_file=Path(self.ca) if self.ca else None)

    def sim_file(self, node: str) -> Path:
        if self.gpu_backend != "sim":
            raise LocalFleetError(
                f"this local fleet runs on real GPUs (--gpu-backend {self.gpu_backend}): "
                "it has no simulated GPU to inject a fault into"
            )
        path = self.path / "nodes" / node / "data" / "sim-gpus.json"
        if not path.exists():
            known = ", ".join(p.node for p in self.processes if p.node) or "none"
            raise LocalFleetError(f"node {node!r} is not part of this local fleet (nodes: {known})")
        return path


GPU_BACKENDS = ("sim", "nvml")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_mosquitto() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)),
        None,
    )


def write_mosquitto_conf(path: Path, port: int, *, extra: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"listener {port} 127.0.0.1\n"
        "allow_anonymous true\n"
        "persistence false\n"
        "log_dest stderr\n"
        "log_type error\nlog_type warning\nlog_type notice\n"
        "max_keepalive 600\n"
        f"{extra}"
    )


# Popen objects of the processes this interpreter started: kept so that they are not
# garbage-collected (with a ResourceWarning) while the fleet runs.
_CHILDREN: list[subprocess.Popen[bytes]] = []


def _spawn(
    cmd: list[str], log: Path, role: str, node: str | None = None, env: dict[str, str] | None = None
) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    _CHILDREN.append(proc)
    return Proc(role=role, pid=proc.pid, log=str(log), node=node)


def start_broker(directory: Path, port: int, kind: str = "auto") -> Proc:
    """Mosquitto where it is installed (or asked for), else the embedded amqtt broker."""
    mosquitto = find_mosquitto() if kind in ("auto", "mosquitto") else None
    if kind == "mosquitto" and mosquitto is None:
        raise LocalFleetError("Mosquitto is not installed (apt-get install -y mosquitto)")
    if mosquitto is not None:
        conf = directory / "broker" / "mosquitto.conf"
        write_mosquitto_conf(conf, port)
        return _spawn([mosquitto, "-c", str(conf)], directory / "logs" / "broker.log", "broker")
    try:
        import amqtt  # noqa: F401
    except ImportError:
        raise LocalFleetError(
            "no MQTT broker: install Mosquitto (apt-get install -y mosquitto) or the embedded "
            "broker (pip install 'phalanx[embedded-broker]')"
        ) from None
    conf = directory / "broker" / "amqtt.yaml"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(
        "listeners:\n  default:\n    type: tcp\n"
        f"    bind: 127.0.0.1:{port}\n"
        "plugins:\n  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
        "    allow_anonymous: true\n"
    )
    amqtt_bin = shutil.which("amqtt") or str(Path(sys.executable).parent / "amqtt")
    return _spawn([amqtt_bin, "-c", str(conf)], directory / "logs" / "broker.log", "broker")


def wait_port(port: int, timeout: float, proc: Proc) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        if not proc.alive():
            raise LocalFleetError(
                f"the {proc.role} exited at start; see {proc.log}:\n{_tail(Path(proc.log))}"
            )
        time.sleep(0.05)
    raise LocalFleetError(f"the {proc.role} did not listen on port {port} within {timeout:.0f}s")


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _write_private(path: Path, text: str) -> None:
    """``text`` in ``path``, created readable by its owner only (0600) from the start."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text + "\n")
    path.chmod(0o600)  # an older file kept its mode


def node_name(i: int) -> str:
    return f"n{i + 1:02d}"


def up(
    directory: Path,
    *,
    nodes: int,
    gpus_per_node: int,
    nodes_per_rack: int = 2,
    heartbeat_s: float = 1.0,
    offline_after_s: float = 4.0,
    timeout: float = 60.0,
    broker: str = "auto",
    spares: int = 0,
    tls: bool = False,
    gpu_backend: str = "sim",
    store_url: str = "",
    standbys: int = 0,
) -> Fleet:
    """Start a fleet and return once every agent is up in the supervisor; ``spares`` of
    its idle nodes are held back as hot spares. With ``tls`` every HTTP hop is HTTPS,
    with a throw-away CA and certificates made under ``DIR/tls``. ``gpu_backend``
    "nvml": one agent (``nodes`` must be 1) on this machine's real GPUs, read through
    NVML, its ranks on them (``gpus_per_node`` is then what NVML counts, not asked).
    ``store_url``: the supervisors' store, a PostgreSQL database (empty: SQLite in the
    fleet's folder); ``standbys``: more supervisors on it, standing by to lead (high
    availability, docs/operations.md); the fleet's API is then every supervisor's URL,
    comma-separated, the first to start (the leader) first."""
    if standbys < 0 or (standbys and not store_url):
        raise LocalFleetError(
            f"--standbys {standbys}: standby supervisors share the leader's store, "
            "which must be PostgreSQL: give --store-url postgresql://..."
        )
    if store_url and not store_url.startswith(("postgresql://", "postgres://")):
        raise LocalFleetError(f"--store-url {store_url!r}: a postgresql:// URL")
    if gpu_backend not in GPU_BACKENDS:
        raise LocalFleetError(
            f"gpu_backend: {gpu_backend!r} is not one of {', '.join(GPU_BACKENDS)}"
        )
    if gpu_backend == "nvml" and nodes != 1:
        raise LocalFleetError(
            f"--nodes {nodes} with --gpu-backend nvml: one machine's GPUs are one node; "
            "run one agent (--nodes 1), or simulated GPUs for a bigger local fleet"
        )
    directory = directory.absolute()
    existing: Fleet | None = None
    with contextlib.suppress(LocalFleetError):
        existing = Fleet.load(directory)
    if existing is not None and any(p.alive() for p in existing.processes):
        raise LocalFleetError(
            f"a local fleet is already running in {directory}; stop it with `phalanx local down`"
        )
    for sub in ("supervisor", "nodes", "broker", "tls"):
        shutil.rmtree(directory / sub, ignore_errors=True)
    for old in directory.glob("supervisor-*"):
        shutil.rmtree(old, ignore_errors=True)
    (directory / "logs").mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(24)
    token_file = directory / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    # The fleet agent secret stays with the supervisor; each agent gets only its own
    # token, derived from it (phalanx.agent_tokens).
    agent_secret = new_secret()
    agent_secret_file = directory / "supervisor" / "agent-secret"
    broker_port = free_port()
    api_ports = [free_port() for _ in range(1 + standbys)]
    authority: Authority | None = None
    if tls:  # cryptography is imported only where it is used
        from phalanx.certs import make_authority

        authority = make_authority(directory / "tls")
    scheme = "https" if tls else "http"
    fleet = Fleet(
        str(directory),
        ",".join(f"{scheme}://127.0.0.1:{port}" for port in api_ports),
        token,
        broker_port,
        [],
        ca=str(authority.ca) if authority else "",
        gpu_backend=gpu_backend,
    )
    try:
        broker_proc = start_broker(directory, broker_port, broker)
        fleet.processes.append(broker_proc)
        fleet.save()
        wait_port(broker_port, 20, broker_proc)

        (directory / "supervisor").mkdir(parents=True)
        _write_private(agent_secret_file, agent_secret)
        api_tls = authority.issue("supervisor") if authority else None
        for i, port in enumerate(api_ports):  # the leader first, then the standbys
            sup_dir = directory / ("supervisor" if i == 0 else f"supervisor-s{i}")
            sup_dir.mkdir(parents=True, exist_ok=True)
            ha = ""
            if store_url:
                ha = (
                    f"[store]\nurl = {json.dumps(store_url)}\n"
                    f'[ha]\napi_url = "{scheme}://127.0.0.1:{port}"\n'
                )
            (sup_dir / "supervisor.toml").write_text(
                f'state_dir = "{sup_dir / "state"}"\n'
                f"offline_after_s = {offline_after_s}\n"
                f"spares = {spares}\n"
                # Every node here shares this machine's CPUs: a link probe on loopback
                # measures how busy they are, not a link. Small probes, and only a link
                # that carries almost nothing keeps a node out.
                f"screen_probe_bytes = {LOCAL_PROBE_BYTES}\nscreen_min_p2p = {LOCAL_MIN_P2P}\n"
                f'agent_token_file = "{agent_secret_file}"\n'
                + (f'agent_tls = true\nagent_ca_file = "{authority.ca}"\n' if authority else "")
                + f"[mqtt]\nport = {broker_port}\nkeepalive_s = 5\n"
                f'[api]\nport = {port}\ntoken_file = "{token_file}"\n'
                + (
                    f'tls_cert_file = "{api_tls.cert}"\ntls_key_file = "{api_tls.key}"\n'
                    if api_tls
                    else ""
                )
                + ha
            )
            sup = _spawn(
                [sys.executable, "-m", "supervisor", "--config", str(sup_dir / "supervisor.toml")],
                directory / "logs" / ("supervisor.log" if i == 0 else f"supervisor-s{i}.log"),
                "supervisor",
            )
            fleet.processes.append(sup)
            fleet.save()
            wait_port(port, 20, sup)

        shm = fleet_shm_dir(directory)
        shm.mkdir(mode=0o700, parents=True, exist_ok=True)
        for i in range(nodes):
            node = node_name(i)
            node_dir = directory / "nodes" / node
            node_dir.mkdir(parents=True)
            node_token_file = node_dir / "agent-token"
            _write_private(node_token_file, node_token(agent_secret, node))
            (node_dir / "agentd.toml").write_text(
                agent_toml(
                    node,
                    node_dir / "data",
                    broker_port,
                    gpus_per_node,
                    rack=f"rack{i // nodes_per_rack + 1}",
                    heartbeat_s=heartbeat_s,
                    token_file=node_token_file,
                    object_store=directory / "objects",
                    tls=authority.issue(node) if authority else None,
                    ca=authority.ca if authority else None,
                    gpu_backend=gpu_backend,
                    shm_dir=shm,
                )
            )
            # Ranks find this Python (and its torch) first on PATH, as in an activated venv.
            path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
            fleet.processes.append(
                _spawn(
                    [sys.executable, "-m", "agentd", "--config", str(node_dir / "agentd.toml")],
                    directory / "logs" / f"agent-{node}.log",
                    "agent",
                    node,
                    env={"PATH": path},
                )
            )
        fleet.save()
        wait_nodes(fleet, [node_name(i) for i in range(nodes)], "up", timeout)
    except BaseException:
        down(directory, quiet=True)
        raise
    return fleet


def agent_toml(
    node: str,
    data_dir: Path,
    broker_port: int,
    gpus: int,
    *,
    rack: str,
    heartbeat_s: float,
    token_file: Path | None = None,
    object_store: Path | None = None,
    tls: Issued | None = None,
    ca: Path | None = None,
    gpu_backend: str = "sim",
    xid_hold_s: float = 30.0,
    shm_dir: Path | None = None,
) -> str:
    """An agent's config; ``object_store`` is the folder every node's object tier shares
    (so any node restores from it), as an S3 bucket would be. With ``tls`` the agent
    serves HTTPS with that certificate, and verifies its peers against ``ca``. With
    ``gpu_backend`` "nvml" it reads this machine's real GPUs (``gpus`` unused) and
    keeps an XID's reason for the agent's default hour, as on a GPU node; a simulated
    one keeps it ``xid_hold_s``."""
    if gpu_backend == "nvml":
        gpu = '[gpu]\nbackend = "nvml"\nsample_interval_s = 1.0\n'
        thresholds = "[thresholds]\nslowdown_sustain_s = 5\n"
    else:
        gpu = f'[gpu]\nbackend = "sim"\nsim_gpus = {gpus}\nsample_interval_s = 0.5\n'
        thresholds = f"[thresholds]\nxid_hold_s = {xid_hold_s}\nslowdown_sustain_s = 5\n"
    return (
        f'node_id = "{node}"\naddress = "127.0.0.1"\nrack = "{rack}"\n'
        f'data_dir = "{data_dir}"\nheartbeat_interval_s = {heartbeat_s}\n'
        f"[mqtt]\nport = {broker_port}\nkeepalive_s = 5\n"
        + gpu
        + thresholds
        + "disk_drain_bytes = 0\ndisk_warn_fraction = 0.0\nload_warn_per_cpu = 64\n"
        'mem_warn_fraction = 0.0\n[http]\nhost = "127.0.0.1"\nport = 0\n'
        + (f'token_file = "{token_file}"\n' if token_file else "")
        + (f'tls_cert_file = "{tls.cert}"\ntls_key_file = "{tls.key}"\n' if tls else "")
        + (f'tls_ca_file = "{ca}"\n' if tls and ca else "")
        + (
            "[ckpt]\n"
            + (f'object_store = "{object_store.absolute().as_uri()}"\n' if object_store else "")
            + (f'shm_dir = "{shm_dir}"\n' if shm_dir else "")
            if object_store or shm_dir
            else ""
        )
    )


# The link probes of a fleet on one machine (see up()).
LOCAL_PROBE_BYTES = 4 << 20
LOCAL_MIN_P2P = 0.05


def fleet_shm_dir(directory: Path) -> Path:
    """The RAM tier's folder of the local fleet in ``directory``: its own, under /dev/shm
    (where the machine has one), so that ``down`` removes what its jobs left there."""
    tag = hashlib.sha256(str(directory.absolute()).encode()).hexdigest()[:12]
    base = Path("/dev/shm")
    return base / f"phalanx-local-{tag}" if base.is_dir() else directory / "shm"


def wait_nodes(fleet: Fleet, nodes: list[str], state: str, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    client = fleet.client()
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        for proc in fleet.processes:
            if proc.node in nodes and not proc.alive() and state != "offline":
                raise LocalFleetError(
                    f"agent {proc.node} exited; see {proc.log}:\n{_tail(Path(proc.log))}"
                )
        with contextlib.suppress(ApiError):
            seen = client.get("/v1/nodes")
            states = {n["id"]: n["state"] for n in seen}
            if all(states.get(n) == state for n in nodes):
                return seen
        time.sleep(0.1)
    got = {n["id"]: n["state"] for n in seen}
    raise LocalFleetError(f"nodes not {state} within {timeout:.0f}s: {got}")


def down(directory: Path, *, quiet: bool = False, timeout: float = 10.0) -> list[Proc]:
    """Stop everything the fleet started: agents first, then supervisor, then broker."""
    try:
        fleet = Fleet.load(directory.absolute())
    except LocalFleetError:
        if quiet:
            return []
        raise
    order = {"agent": 0, "supervisor": 1, "broker": 2}
    procs = sorted(fleet.processes, key=lambda p: order.get(p.role, 3))
    for role in ("agent", "supervisor", "broker"):
        group = [p for p in procs if p.role == role and p.alive()]
        for p in group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(p.alive() for p in group) and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in group:
            if p.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    (fleet.path / "fleet.json").unlink(missing_ok=True)
    # What the jobs left in the RAM tier (the agents free a slot a while after its job
    # ends; they were stopped before).
    shutil.rmtree(fleet_shm_dir(fleet.path), ignore_errors=True)
    return procs
