"""The rig's fleet on namespace hosts: one control host (Mosquitto, the supervisor, an
S3-protocol object store) and GPU hosts (an agent each, simulated GPUs, two racks, a
loop-mounted filesystem of its own for the NVMe tier).

Everything is reached over the bridge, never loopback: the agents dial the broker and the
object store at the control host's address, the ranks rendezvous at rank 0's host, the
peer tier pushes to the buddy's address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

from phalanx.agent_tokens import new_secret, node_token
from phalanx.client import ApiError, Client
from phalanx.local import LOCAL_MIN_P2P, find_mosquitto
from phalanx.simgpu import inject as sim_inject
from tests.harness import rank_pid
from tests.rig import shards
from tests.rig.base import Fleet
from tests.rig.hosts import Host, NetnsHost
from tests.rig.net import (
    PREFIX,
    Network,
    RigError,
    claim_lock,
    leftovers,
    process_started,
    rig_names,
    sh,
    teardown,
)

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
BROKER_PORT = 1883
API_PORT = 8740
S3_PORT = 9000
BUCKET = "phalanx-rig"
NVME_MIB = 300  # each GPU host's NVMe filesystem: a loop-mounted ext4 image
GPUS_PER_HOST = 2
LOG_ROOT = Path("/tmp/phalanx-rig-logs")  # kept after a run, for the failures' post-mortem
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "rig",
    "AWS_SECRET_ACCESS_KEY": "rig-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class RigFleet(Fleet):
    """``RigFleet.running(gpu_hosts=4, spares=1)`` builds it; ``down()`` removes all of it."""

    def __init__(self, net: Network, hosts: list[NetnsHost], token: str) -> None:
        self.net = net
        self.hosts: list[NetnsHost] = hosts
        self.token = token
        self.spares = 1
        self._s3_client: Any = None

    # --- building --------------------------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def running(cls, gpu_hosts: int = 4, spares: int = 1) -> Iterator[RigFleet]:
        """The fleet, removed on the way out whatever happened (Ctrl-C included)."""
        net = Network.create()
        fleet = cls(net, [], secrets.token_hex(16))
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        interrupted = False
        try:
            fleet._build(gpu_hosts, spares)
            yield fleet
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            # Interrupted, the daemons are killed at once: under pytest-xdist the worker
            # has ~10 s before its controller kills it (SIGINT again after 5 s).
            with _interrupts_deferred():
                fleet.down(grace=0.0 if interrupted else 10.0)

    def _build(self, gpu_hosts: int, spares: int) -> None:
        self.spares = spares
        for i in range(gpu_hosts + 1):
            ns = self.net.add_host(i)
            name = "ctl" if i == 0 else f"h{i}"
            host = NetnsHost(
                name=name,
                address=self.net.address(i),
                rack=f"rack{(i + 1) % 2 + 1}",
                roles=["control"] if i == 0 else ["gpu"],
                namespace=ns,
            )
            self.hosts.append(host)
        self._start_control()
        for host in self.gpu_hosts:
            self._mount_nvme(host)
            self.start_agent(host)
        self.wait_nodes("up", [h.name for h in self.gpu_hosts], 60)

    @property
    def dir(self) -> Path:
        return self.net.state.dir

    @property
    def control(self) -> NetnsHost:
        return self.hosts[0]

    @property
    def gpu_hosts(self) -> list[NetnsHost]:
        return self.hosts[1:]

    def _track(self, pid: int) -> None:
        self.net.state.pids.append(pid)
        self.net.state.save()

    def _start_control(self) -> None:
        ctl, d = self.control, self.dir / "ctl"
        d.mkdir(parents=True, exist_ok=True)
        self.start_broker()
        proc = ctl.start(
            "s3",
            [
                str(Path(sys.executable).parent / "moto_server"),
                "-H",
                ctl.address,
                "-p",
                str(S3_PORT),
            ],
            d / "s3.log",
        )
        self._track(proc.pid)
        _wait(lambda: _tcp_open(ctl.address, S3_PORT), 30, "the S3 server")
        self._s3().create_bucket(Bucket=BUCKET)
        (d / "token").write_text(self.token)
        (self.dir / "agent-secret").write_text(new_secret())  # the supervisor's alone
        self.start_supervisor()

    def _s3(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=f"http://{self.control.address}:{S3_PORT}",
            aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"],
            region_name=S3_ENV["AWS_DEFAULT_REGION"],
        )

    def start_broker(self) -> None:
        ctl, d = self.control, self.dir / "ctl"
        binary = find_mosquitto()
        if binary is None:
            raise RigError("the rig needs Mosquitto: apt-get install -y mosquitto")
        conf = d / "mosquitto.conf"
        conf.write_text(
            f"listener {BROKER_PORT} {ctl.address}\nallow_anonymous true\npersistence false\n"
            "log_dest stderr\nlog_type error\nlog_type warning\nmax_keepalive 600\n"
        )
        proc = ctl.start("broker", [binary, "-c", str(conf)], d / "broker.log")
        self._track(proc.pid)
        _wait(lambda: _tcp_open(ctl.address, BROKER_PORT), 20, "mosquitto")

    def start_supervisor(self) -> None:
        ctl, d = self.control, self.dir / "ctl"
        conf = d / "supervisor.toml"
        conf.write_text(
            f'state_dir = "{d / "state"}"\noffline_after_s = 4.0\n'
            # The hosts share this machine's CPUs with each other and, under make rig, with
            # another scenario's fleet: a link probe over veth measures how busy they are as
            # much as the link, and a healthy node read under half the median (25-49 %) kept
            # a spare out. Only a link under 5 % of it keeps a node out here (slow-spare's,
            # capped by tbf, is ~0.01 %); the probes' size stays the default.
            f"screen_min_p2p = {LOCAL_MIN_P2P}\n"
            f'agent_token_file = "{self.dir / "agent-secret"}"\nschedule_interval_s = 0.5\n'
            f"spares = {self.spares}\n"
            f'[mqtt]\nhost = "{ctl.address}"\nport = {BROKER_PORT}\nkeepalive_s = 5\n'
            "reconnect_max_s = 1.0\n"
            f'[api]\nhost = "{ctl.address}"\nport = {API_PORT}\n'
            f'token_file = "{d / "token"}"\n'
        )
        proc = ctl.start(
            "supervisor",
            [sys.executable, "-m", "supervisor", "--config", str(conf)],
            d / "supervisor.log",
        )
        self._track(proc.pid)
        _wait(lambda: _tcp_open(ctl.address, API_PORT), 30, "the supervisor's API")

    def nvme(self, host: Host) -> Path:
        return self.dir / host.name / "data" / "ckpt"

    def _mount_nvme(self, host: NetnsHost) -> None:
        image, mount = self.dir / host.name / "nvme.img", self.nvme(host)
        mount.mkdir(parents=True, exist_ok=True)
        with image.open("wb") as fh:
            fh.truncate(NVME_MIB << 20)
        sh("mkfs.ext4", "-q", "-F", "-m", "0", str(image), timeout=60)
        self.net.state.mounts.append(str(mount))
        self.net.state.save()
        sh("mount", "-o", "loop", str(image), str(mount))

    def shm(self, host: Host) -> Path:
        return Path("/dev/shm") / f"phalanx-rig-{self.net.state.rid}-{host.name}"

    def start_agent(self, host: NetnsHost) -> None:
        d = self.dir / host.name
        shm = self.shm(host)
        shm.mkdir(parents=True, exist_ok=True)
        ctl = self.control
        conf = d / "agentd.toml"
        # The host's own agent token, derived from the fleet secret (phalanx.agent_tokens).
        token = d / "agent-token"
        token.parent.mkdir(parents=True, exist_ok=True)
        secret = (self.dir / "agent-secret").read_text().strip()
        token.write_text(node_token(secret, host.name) + "\n")
        token.chmod(0o600)
        conf.write_text(
            f'node_id = "{host.name}"\naddress = "{host.address}"\nrack = "{host.rack}"\n'
            f'data_dir = "{d / "data"}"\nheartbeat_interval_s = 1.0\nstop_grace_s = 5\n'
            f'[mqtt]\nhost = "{ctl.address}"\nport = {BROKER_PORT}\nkeepalive_s = 5\n'
            "reconnect_max_s = 1.0\n"
            f'[gpu]\nbackend = "sim"\nsim_gpus = {GPUS_PER_HOST}\nsample_interval_s = 0.5\n'
            "[thresholds]\nxid_hold_s = 30\nslowdown_sustain_s = 5\n"
            "disk_drain_bytes = 0\ndisk_warn_fraction = 0.0\nload_warn_per_cpu = 64\n"
            "mem_warn_fraction = 0.0\n"
            f'[http]\nhost = "{host.address}"\nport = 9400\n'
            f'token_file = "{token}"\n'
            f'[ckpt]\nobject_store = "s3://{BUCKET}/ckpt"\nshm_dir = "{shm}"\n'
        )
        env = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://{ctl.address}:{S3_PORT}"}
        proc = host.start(
            "agent",
            [sys.executable, "-m", "agentd", "--config", str(conf)],
            d / "agent.log",
            env=env,
        )
        self._track(proc.pid)

    # --- using ---------------------------------------------------------------------------

    def client(self) -> Client:
        return Client(f"http://{self.control.address}:{API_PORT}", self.token)

    def wait_nodes(self, state: str, names: list[str], timeout: float) -> None:
        def ready() -> bool:
            try:
                nodes = {n["id"]: n for n in self.client().get("/v1/nodes")}
            except (ApiError, OSError):
                return False
            return all(nodes.get(n, {}).get("state") == state for n in names)

        _wait(ready, timeout, f"nodes {', '.join(names)} {state}")

    def sim_file(self, host: Host) -> Path:
        return self.dir / host.name / "data" / "sim-gpus.json"

    def rank_log(self, job: dict[str, Any], rank: int) -> str:
        node = next(r["node"] for r in job["ranks"] if r["rank"] == rank)
        path = self.dir / node / "data" / "jobs" / job["id"] / f"g{job['generation']}"
        return (path / f"rank-{rank}.log").read_text(errors="replace")

    # --- the Fleet interface (tests/rig/base.py): what the faults and the driver do ------

    def daemon_host(self, role: str) -> NetnsHost:
        return self.control

    def job_runtime(self) -> dict[str, str]:
        return {"python": sys.executable, "workdir": str(REPO)}

    def kill_rank(self, host: Host, job_id: str, rank: int, generation: int) -> None:
        pid = rank_pid(job_id, rank, generation=generation)
        if pid is None:
            raise RigError(f"rank {rank} of {job_id} is not running")
        os.kill(pid, signal.SIGKILL)

    def object_shards(self, job_id: str, step: int) -> set[str]:
        if self._s3_client is None:
            self._s3_client = self._s3()
        prefix = f"ckpt/{job_id}/{step:012d}/"
        listed = self._s3_client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
        return {o["Key"].rsplit("/", 1)[1].split(".")[0] for o in listed}

    def kill(self, host: Host, role: str) -> None:
        self.host(host.name).kill(role)

    def restart(self, host: Host, role: str) -> None:
        if role == "agent":
            self.start_agent(self.host(host.name))
        elif role == "broker":
            self.start_broker()
        elif role == "supervisor":
            self.start_supervisor()
        else:
            raise RigError(f"the rig has no daemon {role!r}")

    def stop_object_store(self) -> None:
        self.control.signal("s3", signal.SIGSTOP)

    def continue_object_store(self) -> None:
        self.control.signal("s3", signal.SIGCONT)

    def inject_gpu(self, host: Host, gpu: int, fault: str) -> None:
        sim_inject(self.sim_file(host), gpu, fault)

    def fill_disk(self, host: Host) -> int:
        nvme = self.nvme(host)
        host.run(*host.fill(nvme), timeout=120)
        return os.statvfs(nvme).f_bavail * os.statvfs(nvme).f_frsize

    def unfill_disk(self, host: Host) -> None:
        host.run(*host.unfill(self.nvme(host)), check=False)

    def wait_new_step(self, host: Host, job_id: str, timeout: float) -> str | None:
        job_dir = self.nvme(host) / job_id
        before = {p.name for p in job_dir.glob("*")} if job_dir.exists() else set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = {p.name for p in job_dir.glob("*")} if job_dir.exists() else set()
            if now - before:  # a new step is being written down
                return sorted(now - before)[-1]
            time.sleep(0.005)
        return None

    def newest_slot(self, host: Host, job_id: str, rank: int) -> tuple[PurePath, int, int]:
        return shards.newest_slot(self.shm(host), job_id, rank)

    def file_size(self, host: Host, path: PurePath) -> int | None:
        local = Path(path)
        return local.stat().st_size if local.exists() else None

    def flip(self, host: Host, path: PurePath, start: int, nbytes: int) -> None:
        shards.flip(Path(path), start, nbytes)

    def cut_link_for_good(self, host: Host) -> None:
        host.run("ip", "link", "set", host.iface, "down")

    @property
    def logs(self) -> Path:
        """Where the run's logs are kept after ``down`` (daemons' and ranks')."""
        return LOG_ROOT / self.net.state.rid

    def down(self, grace: float = 10.0) -> list[str]:
        """Stop every daemon (SIGTERM, and SIGKILL for those not gone within ``grace``
        seconds, all at once), keep the logs, remove everything the run made."""
        procs = [host.processes.pop(role) for host in self.hosts for role in list(host.processes)]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM if grace > 0 else signal.SIGKILL)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
        for path in self.dir.rglob("*.log"):
            if path.is_file():
                kept = self.logs / path.relative_to(self.dir)
                kept.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):
                    shutil.copyfile(path, kept)
        for host in self.gpu_hosts:
            shutil.rmtree(self.shm(host), ignore_errors=True)
        problems = teardown(self.net.state)
        for p in problems:
            log.error("rig cleanup: %s", p)
        return problems


def down_all(everything: bool = True) -> dict[str, list[str]]:
    """Remove what runs left on this machine; never a live run (whose owner still runs),
    which is ``kept``. ``everything`` (``python -m tests.rig down``): also the runs that do
    not name their owner (a rig older than that) and rig names no run's state names; else
    (the sweep around ``pytest -m rig``) only the runs whose owner is gone."""
    with claim_lock():  # no run half-claimed while we look
        runs = leftovers()
        names = rig_names()
    removed: list[str] = []
    kept: list[str] = []
    for state in runs:
        alive = state.owner_alive()
        if alive or (alive is None and not everything):
            kept.append(state.rid)
            continue
        for shm in Path("/dev/shm").glob(f"phalanx-rig-{state.rid}-*"):
            shutil.rmtree(shm, ignore_errors=True)
        teardown(state)
        removed.append(state.rid)
    if everything:
        known = {state.rid for state in runs}
        for name in names:
            if name[len(PREFIX) :][:4] in known:
                continue  # a run's: removed above, or live
            probe = name.removeprefix(f"{PREFIX}probe")
            if probe != name and probe.isdigit() and process_started(int(probe)):
                continue  # a live process's probe (net.can_build)
            sh("ip", "netns", "del", name, check=False)
            sh("ip", "link", "del", name, check=False)
            removed.append(name)
    return {"removed": removed, "kept": kept}


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is done (a teardown is not cut short),
    then raise KeyboardInterrupt. Only the main thread can set handlers: elsewhere, as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: came.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if came:
        raise KeyboardInterrupt(f"signal {came[0]} (deferred during the rig's teardown)")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _tcp_open(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _wait(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise RigError(f"not within {timeout:.0f} s: {what}")
