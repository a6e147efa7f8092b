"""The control plane at fleet size: a real broker and supervisor, N simulated agents.

    python bench/fleet_scale.py --nodes 2048 [--workload big|mixed] [--steady 120] [--ckpt-every 30]

Starts a real Mosquitto (its own config: no queue limits, file descriptors raised to
the hard limit) and a real supervisor (its own config and store, a subprocess), then
the fleet: ``--nodes`` nodes for the job plus ``--spares`` hot spares, simulated by
``bench/fleet_sim.py`` processes of ``--per-process`` agents each (the agent's own wire
code, one MQTT connection per node). The workload ``big`` is one job on every node but
the spares (8 ranks a node: 2,048 nodes are 16,384 ranks), stepping every ``--step``
seconds and checkpointing every ``--ckpt-every`` seconds at RAM, NVMe, peer and object.
The workload ``mixed`` is a fleet of ``--nodes`` nodes: 5 % hot spares, one such job on
half of them, and ``--small-jobs`` small jobs (1 to 16 nodes, 8 ranks a node, a
checkpoint every 20 s at RAM and NVMe) submitted at once, which queue for the rest of
the fleet and finish (their simulated ranks exit 0 after ``--small-steps`` steps and
up to 9 more), for the scheduler to place the next.

Once the job runs, ``--steady`` seconds of steady state are measured (the supervisor's
CPU and RSS, the store's growth, heartbeat lag, REST latency), the dashboard's fleet page
is loaded in headless chromium ``--browser`` times (to a tile for every node), then
faults are injected
one after the other, each waited out: an ECC drain on a node of the job, a node lost
(its connection cut: the broker sends its will), a hang report, a broker restart. At
the end every message sent (rank events, landings, metrics batches) is compared with
what the supervisor counted (``/v1/stats``). Prints one JSON object; a step's commit is
timed from its last landing handed to its node's link (``commit_after_last_landing_s``)
and from the broker's delivery of it (``..._delivered_s``: the supervisor's and the
broker's share), and taken apart in ``commit_steps`` and ``steady_commit_phases``
(the supervisor's account of its flushes and publishes, ``/v1/stats``: ``catalogs``).

Connections per process: each simulated node holds one MQTT connection, i.e. one
socket plus the paho client's wake-up socket pair (three descriptors), so 512 agents a
process need ~1,600 descriptors (the process raises its soft limit to the hard one).
Mosquitto holds one descriptor per connection; its limit is raised the same way and
``max_connections`` is left unlimited. The count per process is bounded by CPU, not
descriptors: at 512 one process's event loop handles its nodes' catalogs (one per node
and commit) in well under a heartbeat interval.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import multiprocessing
import multiprocessing.synchronize
import os
import queue
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phalanx.client import ApiError, Client
from phalanx.local import find_mosquitto, free_port
from supervisor.recovery.planner import NO_PROGRESS_RESTORES as NO_PROGRESS
from supervisor.telemetry.wire_stats import quantile

TOKEN = "bench-token-0123456789abcdef"
JOB = "scale"
SENT_AT = re.compile(rb'"sent_at":\s*([0-9.eE+-]+)')
ROUTES = ("/v1/nodes", "/v1/jobs", "/v1/jobs/{id}", "/metrics")


def poll_rest(
    url: str,
    job_id: str,
    every: float,
    *,
    stop: multiprocessing.synchronize.Event,
    answers: multiprocessing.SimpleQueue[dict[str, list[float]]],
) -> None:
    """In a process of its own, until ``stop``: each route of ``ROUTES`` asked for in turn,
    every ``every`` seconds, as a client would (the answer read and parsed); the seconds
    each took, by route, put in ``answers`` at the end."""
    client = Client(url, TOKEN, timeout=30)
    latencies: dict[str, list[float]] = {r: [] for r in ROUTES}
    while not stop.is_set():
        for route in ROUTES:
            path = route.replace("{id}", job_id)
            t = time.perf_counter()
            try:
                if route == "/metrics":
                    client.get_bytes(path)
                else:
                    client.get(path)
            except ApiError:
                continue
            latencies[route].append(time.perf_counter() - t)
        stop.wait(every)
    answers.put(latencies)


def raise_fd_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def store_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in state.glob("state.db*") if p.is_file())


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class SimProcess:
    """One ``fleet_sim.py`` process: orders in on stdin, events out on stdout."""

    def __init__(self, args: list[str], log: Path, nice: int = 0) -> None:
        def setup() -> None:
            raise_fd_limit()
            os.nice(nice)

        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "fleet_sim.py"), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("ab"),
            text=True,
            preexec_fn=setup,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.reports: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                (self.reports if record.get("ev") == "report" else self.events).put(record)

    def order(self, **order: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(order) + "\n")
        self.proc.stdin.flush()

    def report(self, timeout: float = 60.0) -> dict[str, Any]:
        self.order(op="report")
        return self.reports.get(timeout=timeout)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.order(op="quit")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


TIERS = frozenset({"ram", "nvme", "peer", "object"})  # the big job's checkpoint tiers


class OrderWatch:
    """The start orders and catalogs as the broker hands them out: a subscriber of every
    node's command topic and every job's catalogs (QoS 0, its own thread) records when
    each generation's orders were delivered, and when each node's catalog first said a
    step was committed at every tier. A fault → "orders out" and a step's commit → its
    catalogs out are timed by it, apart from how fast the simulated nodes, starved of
    CPU beside the supervisor, take them."""

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as mqtt

        self.seen: dict[tuple[str, int], list[float]] = {}
        # (job, step) -> when each node's catalog first listed it committed at every tier
        self.complete: dict[tuple[str, int], list[float]] = {}
        self._complete_at: set[tuple[str, int, str]] = set()
        self._lock = threading.Lock()
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-orders")
        # Heartbeats too: (when delivered here, how long after their node stamped them),
        # the simulators' and the broker's share of the heartbeat lag the supervisor sees.
        self.heartbeats: list[tuple[float, float]] = []
        # (job, step) -> when the broker delivered its last landing here: a step's commit
        # timed from it leaves out how late the starved simulators sent it (the
        # supervisor's and the broker's share of the commit).
        self.landed: dict[tuple[str, int], float] = {}
        self._client.on_connect = lambda c, *_: c.subscribe(
            [
                ("phalanx/v1/node/+/cmd", 0),
                ("phalanx/v1/job/+/ckpt/+", 0),
                ("phalanx/v1/node/+/heartbeat", 0),
                ("phalanx/v1/node/+/ckpt", 0),
            ]
        )
        self._client.on_message = self._on_message
        self._client.reconnect_delay_set(0.2, 1.0)
        self._client.connect("127.0.0.1", port)
        self._client.loop_start()

    def _on_catalog(self, at: float, payload: bytes) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            catalog = json.loads(payload)
            job, node = catalog["job"], catalog["node"]
            for step in catalog["steps"]:
                key = (job, int(step["step"]), node)
                if key not in self._complete_at and set(step["committed"]) >= TIERS:
                    self._complete_at.add(key)
                    with self._lock:
                        self.complete.setdefault(key[:2], []).append(at)

    def catalogs_of(self, job: str, step: int) -> list[float]:
        with self._lock:
            return list(self.complete.get((job, step), []))

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        at = time.time()
        if message.topic.endswith("/heartbeat"):
            if found := SENT_AT.search(message.payload):
                self.heartbeats.append((at, at - float(found.group(1))))
            return
        if "/ckpt/" in message.topic:
            if message.payload:
                self._on_catalog(at, message.payload)
            return
        if message.topic.endswith("/ckpt"):
            with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                sent = json.loads(message.payload)
                for landing in sent.get("landings", [sent]):
                    if landing.get("event", "landed") == "landed":
                        key = (landing["job"], int(landing["step"]))
                        with self._lock:
                            self.landed[key] = max(self.landed.get(key, 0.0), at)
            return
        if b'"start_ranks"' not in message.payload:
            return
        with contextlib.suppress(ValueError, KeyError, TypeError):
            args = json.loads(message.payload)["args"]
            with self._lock:
                self.seen.setdefault((args["job"], int(args["generation"])), []).append(at)

    def of(self, job: str, generation: int) -> list[float]:
        with self._lock:
            return list(self.seen.get((job, generation), []))

    def close(self) -> None:
        self._client.loop_stop()
        self._client.disconnect()


# The store's own frames: a stall there is told apart by the first frame outside them.
STORE_FRAMES = ("supervisor/store.py", "supervisor/store_guard.py", "supervisor/store_db.py")


def summarize(
    stalls: list[dict[str, Any]], since: float = 0.0, until: float = float("inf")
) -> dict[str, Any]:
    """The stalls (``phalanx.loopwatch.Stall.as_dict``) that began in [since, until):
    how many, how long in all, the longest, and by where (the most seconds first, eight
    at most)."""
    found = [s for s in stalls if since <= s["at"] < until]
    by: dict[str, dict[str, Any]] = {}
    for stall in found:
        key = stall["where"] or stall["leaf"] or "?"
        if key.startswith(STORE_FRAMES):  # the store's: by whose statement it was
            caller = next(
                (f for f in stall.get("stack", "").split(" < ") if not f.startswith(STORE_FRAMES)),
                "",
            )
            key = f"{key} (for {caller})" if caller else key
        one = by.setdefault(
            key, {"where": key, "n": 0, "s": 0.0, "max_s": 0.0, "leaf": "", "stack": ""}
        )
        one["n"] += 1
        one["s"] = round(one["s"] + stall["s"], 3)
        if stall["s"] > one["max_s"]:
            one["max_s"], one["leaf"] = stall["s"], stall["leaf"]
            one["stack"] = stall.get("stack", "")
    return {
        "n": len(found),
        "s": round(sum(s["s"] for s in found), 3),
        # the loop thread's CPU over those stalls (and a tick before each): far less
        # than "s", the loop mostly waited for the CPU (or the disk), not worked
        "cpu_s": round(sum(s.get("cpu_s", 0.0) for s in found), 3),
        "longest_s": max((s["s"] for s in found), default=0.0),
        "by_where": sorted(by.values(), key=lambda w: -w["s"])[:8],
        "over_0_25_s": [
            {k: s.get(k) for k in ("at", "s", "cpu_s", "stack", "leaf")}
            for s in sorted(found, key=lambda s: s["at"])
            if s["s"] >= 0.25
        ][:40],
    }


class StallLog:
    """The supervisor's event loop stalls (``GET /v1/stats``: ``loop``, the last 16),
    polled every second in a thread of its own from the fleet's start to the end, each
    kept once: what held the loop while heartbeats, orders and REST waited. And its
    account of each flush of landings and publish of a job's catalogs (``catalogs``). And
    the cyclic collector's passes of 20 ms or more (``gc``: each stops the loop too)."""

    def __init__(self, port: int) -> None:
        self.stalls: dict[float, dict[str, Any]] = {}
        self.gc: dict[float, dict[str, Any]] = {}
        self.recorded: dict[float, dict[str, Any]] = {}
        self.published: dict[tuple[str, float], dict[str, Any]] = {}
        self._stop = threading.Event()
        self._client = Client(f"http://127.0.0.1:{port}", TOKEN, timeout=30)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(ApiError, OSError):
                stats = self._client.get("/v1/stats")
                for stall in stats.get("loop", {}).get("recent", []):
                    self.stalls.setdefault(stall["at"], stall)
                for pause in stats.get("gc", {}).get("recent", []):
                    self.gc.setdefault(pause["at"], pause)
                catalogs = stats.get("catalogs", {})
                for flush in catalogs.get("recorded", []):
                    self.recorded.setdefault(flush["at"], flush)
                for out in catalogs.get("published", []):
                    self.published.setdefault((out["job"], out["at"]), out)

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
        return summarize(list(self.stalls.values()), since, until)

    def gc_summary(self, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
        """The collector's passes of 20 ms or more that began in [since, until), by
        generation: how many, how long in all, the longest."""
        out: dict[str, Any] = {}
        for pause in self.gc.values():
            if since <= pause["at"] < until:
                one = out.setdefault(f"gen{pause['generation']}", {"n": 0, "s": 0.0, "max_s": 0.0})
                one["n"] += 1
                one["s"] = round(one["s"] + pause["s"], 3)
                one["max_s"] = max(one["max_s"], pause["s"])
        return out

    def commit_of(self, job: str, nodes: int, landed: float, out: float) -> dict[str, Any]:
        """One step's commit, from its last landing (handed to its node's link) to the
        last of its catalogs out of the broker: to the first flush of landings that began
        after it (the landing's way to the supervisor and the batch's wait), that flush's
        recording, then the first publish of the job's catalogs asked for after it (its
        wait, build, hand-off) and what was left to the broker. Approximate: the flush
        that took the last landing may be a later one."""
        flush = min(  # its "at" is rounded to the millisecond
            (
                f
                for f in self.recorded.values()
                if f["at"] >= landed - 0.001 and job in f["changed"]
            ),
            key=lambda f: f["at"],
            default=None,
        )
        if flush is None:
            return {"total_s": round(out - landed, 3)}
        after = flush["at"] + flush["record_s"] - 0.001
        publish = min(
            (
                p
                for p in self.published.values()
                if p["job"] == job and p["messages"] >= nodes and p["at"] >= after
            ),
            key=lambda p: p["at"],
            default=None,
        )
        found: dict[str, Any] = {
            "total_s": round(out - landed, 3),
            "to_flush_s": round(flush["at"] - landed, 3),
            "record_s": flush["record_s"],
        }
        if publish is not None:
            done = publish["at"] + publish["wait_s"] + publish["build_s"] + publish["send_s"]
            found |= {
                "to_publish_s": round(publish["at"] - after, 3),
                **{k: publish[k] for k in ("wait_s", "build_s", "send_s")},
                "broker_s": round(out - done, 3),
            }
        return found

    def commit_phases(
        self, job: str, nodes: int, since: float = 0.0, until: float = float("inf")
    ) -> dict[str, Any]:
        """Where a step's commit went, in [since, until): the flushes of landings that
        changed the job's catalog (how long each took to record), and the publishes of
        its catalogs to at least ``nodes`` nodes (waited for the job's lock, built,
        handed to the broker), each as median and max."""

        def spread(values: list[float]) -> dict[str, float | None]:
            return {"p50": pct(values, 0.5), "max": max(values, default=None)}

        flushes = [
            f for f in self.recorded.values() if since <= f["at"] < until and job in f["changed"]
        ]
        outs = [
            p
            for p in self.published.values()
            if p["job"] == job and p["messages"] >= nodes and since <= p["at"] < until
        ]
        return {
            "flushes": len(flushes),
            "record_s": spread([f["record_s"] for f in flushes]),
            "landings_a_flush": spread([float(f["landings"]) for f in flushes]),
            "publishes": len(outs),
            **{
                f"{phase}_s": spread([p[f"{phase}_s"] for p in outs])
                for phase in ("wait", "build", "send")
            },
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        if args.workload == "mixed":  # --nodes is the fleet: half of it the big job's
            self.fleet = args.nodes
            self.job_nodes = args.nodes // 2
        else:
            self.fleet = args.nodes + args.spares
            self.job_nodes = args.nodes
        self.small: list[str] = []  # the mixed workload's small jobs
        self.broker_port = free_port()
        self.api_port = free_port()
        self.broker: subprocess.Popen[bytes] | None = None
        self.supervisor: subprocess.Popen[bytes] | None = None
        self.spy: subprocess.Popen[bytes] | None = None  # py-spy on the supervisor
        self.orders: OrderWatch | None = None
        self.stall_log: StallLog | None = None
        self.sims: list[SimProcess] = []
        self.api = Client(f"http://127.0.0.1:{self.api_port}", TOKEN, timeout=30)
        self.owner: dict[str, SimProcess] = {}
        self.starts: list[dict[str, Any]] = []  # every start order the fleet received
        self.out: dict[str, Any] = {}
        self.killed = 0  # nodes lost for good (their will)
        self.job_id = ""
        self.steady_window = (0.0, 0.0)  # wall clock

    # --- parts ------------------------------------------------------------------

    def start_broker(self) -> None:
        mosquitto = find_mosquitto()
        if mosquitto is None:
            sys.exit("bench/fleet_scale.py needs Mosquitto (apt-get install -y mosquitto)")
        conf = self.root / "mosquitto.conf"
        conf.write_text(
            f"listener {self.broker_port} 127.0.0.1\nallow_anonymous true\n"
            # As Debian's mosquitto.conf has it (the broker role keeps it): sessions, their
            # queued messages and retained ones survive a broker restart.
            f"persistence true\npersistence_location {self.root}/\n"
            # Started as root, Mosquitto would drop to its own user, which may not write
            # this run's folder: it runs as whoever runs the bench.
            f"user {getpass.getuser()}\n"
            "log_dest stderr\nlog_type error\nlog_type warning\nmax_keepalive 600\n"
            # The supervisor's session must never drop a QoS 1 message (a landing, a rank
            # event) while it is busy: Mosquitto's default queue is 1,000 messages, and a
            # 16,384-rank step lands 65,536 shards within seconds.
            "max_queued_messages 0\nmax_queued_bytes 0\nmax_connections -1\n"
        )
        self.broker = subprocess.Popen(
            [mosquitto, "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=(self.root / "broker.log").open("ab"),
            preexec_fn=raise_fd_limit,
        )
        self.wait(lambda: self._listening(self.broker_port), 10, "mosquitto")

    def start_supervisor(self) -> None:
        d = self.root / "supervisor"
        d.mkdir()
        (d / "token").write_text(TOKEN)
        conf = d / "supervisor.toml"
        conf.write_text(
            f'state_dir = "{d / "state"}"\nspares = {self.args.spares}\n'
            f"offline_after_s = {self.args.offline_after or 3 * self.args.heartbeat}\n"
            f"[mqtt]\nport = {self.broker_port}\nreconnect_max_s = 1.0\n"
            f'[api]\nport = {self.api_port}\ntoken_file = "{d / "token"}"\n'
        )
        self.supervisor = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "--config", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=(self.root / "supervisor.log").open("ab"),
            preexec_fn=raise_fd_limit,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        )
        self.wait(lambda: self.stats()["mqtt_connects"] >= 1, 60, "the supervisor")
        if self.args.profile and self.spy is None:
            self.spy = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "--pid",
                    str(self.supervisor.pid),
                    "--nonblocking",
                    "--format",
                    "raw",
                    "--rate",
                    "50",
                    "--output",
                    self.args.profile,
                ],
                stdout=subprocess.DEVNULL,
                stderr=(self.root / "py-spy.log").open("ab"),
            )

    def start_fleet(self) -> None:
        per = self.args.per_process
        for first in range(0, self.fleet, per):
            count = min(per, self.fleet - first)
            sim = SimProcess(
                [
                    "--port",
                    str(self.broker_port),
                    "--first",
                    str(first),
                    "--count",
                    str(count),
                    "--heartbeat",
                    str(self.args.heartbeat),
                    "--step",
                    str(self.args.step),
                    *([] if self.args.batch_landings else ["--one-landing-a-message"]),
                ],
                self.root / "sim.log",
                nice=self.args.sim_nice,
            )
            self.sims.append(sim)
            for i in range(first, first + count):
                self.owner[f"n{i:05d}"] = sim
        self.wait(lambda: self.nodes_up() >= self.fleet, 120 + self.fleet / 4, "every node up", 2.0)

    def stop(self) -> None:
        if self.orders is not None:
            self.orders.close()
        if self.stall_log is not None:
            self.stall_log.close()
        for sim in self.sims:
            sim.stop()
        if self.spy is not None and self.spy.poll() is None:
            self.spy.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.spy.wait(30)
        for proc in (self.supervisor, self.broker):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)

    # --- helpers ----------------------------------------------------------------

    @staticmethod
    def _listening(port: int) -> bool:
        import socket

        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        return False

    @staticmethod
    def wait(predicate: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = predicate()
            except (ApiError, OSError) as exc:
                last = exc
            else:
                if last:
                    return last
            time.sleep(interval)
        raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = self.api.get("/v1/stats")
        return result

    def nodes_up(self) -> int:
        return sum(n["state"] == "up" for n in self.api.get("/v1/nodes"))

    def job(self) -> dict[str, Any]:
        result: dict[str, Any] = self.api.get(f"/v1/jobs/{self.job_id}")
        return result

    def drain_events(self) -> None:
        for sim in self.sims:
            while True:
                try:
                    record = sim.events.get_nowait()
                except queue.Empty:
                    break
                if record.get("ev") == "start":
                    self.starts.append(record)

    def starts_of(self, generation: int) -> list[dict[str, Any]]:
        self.drain_events()
        return [s for s in self.starts if s["job"] == self.job_id and s["gen"] == generation]

    def reports(self) -> list[dict[str, Any]]:
        return [sim.report() for sim in self.sims]

    # --- the run ----------------------------------------------------------------

    def submit(self) -> None:
        spec = {
            "name": JOB,
            "team": "bench",
            "command": ["sim"],
            "workdir": "/tmp",
            "nodes": self.job_nodes,
            "ranks_per_node": 8,
            "checkpoint": {
                "interval": {"seconds": self.args.ckpt_every},
                "tiers": sorted(TIERS),
            },
            "restart": {"max_restarts": 20, "spare_wait": 120},
        }
        t0 = time.time()
        self.job_id = self.api.post("/v1/jobs", {"spec": spec})["id"]
        self.wait(lambda: len(self.starts_of(1)) >= self.job_nodes, 300, "every start order")
        self.wait(lambda: self.job()["state"] == "running", 120, "the job running")
        self.out["launch_s"] = round(max(s["at"] for s in self.starts_of(1)) - t0, 3)
        if self.args.workload == "mixed":
            self.submit_small()

    def submit_small(self) -> None:
        """The mixed workload's small jobs, all at once: they queue for the nodes neither
        the big job nor the spare pool holds, and finish, for the next to be placed."""
        free = max(1, self.fleet - self.job_nodes - self.args.spares)
        for i in range(self.args.small_jobs):
            spec = {
                "name": f"small{i}",
                "team": "bench",
                "command": ["sim", "--steps", str(self.args.small_steps + i % 10)],
                "workdir": "/tmp",
                "nodes": min(1 << (i % 5), free),  # none that can never start
                "ranks_per_node": 8,
                "checkpoint": {"interval": {"seconds": 20}, "tiers": ["ram", "nvme"]},
            }
            self.small.append(self.api.post("/v1/jobs", {"spec": spec})["id"])

    def small_totals(self) -> None:
        """How the small jobs fared: each one's state, and how long each that started
        waited in the queue (submitted to its first start)."""
        jobs = {j["id"]: j for j in self.api.get("/v1/jobs")}
        states: dict[str, int] = {}
        reasons: dict[str, int] = {}  # a failed one's reason, its numbers out (a kind each)
        waits = []
        for job_id in self.small:
            job = jobs.get(job_id, {})
            states[job.get("state", "missing")] = states.get(job.get("state", "missing"), 0) + 1
            if job.get("state") == "failed":
                why = re.sub(r"command [0-9a-f]+", "command ID", str(job.get("reason", "")))
                kind = re.sub(r"[0-9]+(\.[0-9]+)?", "N", why)[:160]
                reasons[kind] = reasons.get(kind, 0) + 1
            if job.get("first_started_at") and job.get("submitted_at"):
                waits.append(job["first_started_at"] - job["submitted_at"])
        self.out.update(
            small_jobs=len(self.small),
            small_jobs_by_state=states,
            small_jobs_failed_why=reasons,
            small_jobs_started=len(waits),
            small_job_queue_wait_p50_s=pct(waits, 0.5),
            small_job_queue_wait_p99_s=pct(waits, 0.99),
        )

    def steady(self) -> None:
        """``--steady`` seconds: CPU, RSS, store growth, heartbeat lag, REST latency."""
        assert self.supervisor is not None
        pid = self.supervisor.pid
        state = self.root / "supervisor" / "state"
        spawn = multiprocessing.get_context("spawn")
        stop = spawn.Event()
        answers: multiprocessing.SimpleQueue[dict[str, list[float]]] = spawn.SimpleQueue()
        # A process of its own: a thread of this one waited for the GIL behind the order
        # watcher's (every heartbeat and catalog of the fleet parsed here).
        poller = spawn.Process(
            target=poll_rest,
            args=(f"http://127.0.0.1:{self.api_port}", self.job_id, self.args.rest_every),
            kwargs={"stop": stop, "answers": answers},
            daemon=True,
        )

        lag0 = self.stats()["heartbeat_lag_s"]["buckets"]
        others = {
            "broker": [self.broker.pid] if self.broker else [],
            "simulators": [sim.proc.pid for sim in self.sims],
        }
        others0 = {k: sum(proc_cpu_s(p) for p in pids) for k, pids in others.items()}
        cpu0, size0, t0 = proc_cpu_s(pid), store_bytes(state), time.monotonic()
        wall0 = time.time()
        load0 = load()
        poller.start()
        rss = []
        while time.monotonic() - t0 < self.args.steady:
            time.sleep(min(5.0, self.args.steady))
            rss.append(proc_rss_mib(pid))
        stop.set()
        latencies = answers.get()
        poller.join(30)
        elapsed = time.monotonic() - t0
        cpu = proc_cpu_s(pid) - cpu0
        others1 = {k: sum(proc_cpu_s(p) for p in pids) for k, pids in others.items()}
        size = store_bytes(state) - size0
        lag1 = self.stats()["heartbeat_lag_s"]["buckets"]
        buckets = {b: c for b, c in lag1}
        for b, c in lag0:
            buckets[b] -= c
        self.out.update(
            steady_s=round(elapsed, 1),
            load_before=load0,
            load_after=load(),
            supervisor_cpu_pct=round(100 * cpu / elapsed, 1),
            # what else ran on the machine's cores meanwhile (% of one core)
            broker_cpu_pct=round(100 * (others1["broker"] - others0["broker"]) / elapsed, 1),
            simulators_cpu_pct=round(
                100 * (others1["simulators"] - others0["simulators"]) / elapsed, 1
            ),
            supervisor_rss_mib=max(rss),
            store_bytes=store_bytes(state),
            store_growth_mib_per_hour=round(size / elapsed * 3600 / 2**20, 1),
            heartbeat_lag_p50_s=quantile(buckets, 0.5),
            heartbeat_lag_p99_s=quantile(buckets, 0.99),
            heartbeats_in_window=sum(buckets.values()),
        )
        assert self.stall_log is not None
        time.sleep(1.5)  # the stall log's last poll of the window
        self.steady_window = (wall0, wall0 + elapsed)
        if self.orders is not None:  # stamped by the node -> delivered to the bench's watcher
            delivered = [lag for at, lag in list(self.orders.heartbeats) if wall0 <= at]
            self.out["heartbeat_delivery_lag_p50_s"] = pct(delivered, 0.5)
            self.out["heartbeat_delivery_lag_p99_s"] = pct(delivered, 0.99)
        self.out["steady_loop_stalls"] = self.stall_log.summary(*self.steady_window)
        self.out["steady_gc_pauses"] = self.stall_log.gc_summary(*self.steady_window)
        if self.job_id:
            self.out["steady_commit_phases"] = self.stall_log.commit_phases(
                self.job_id, self.job_nodes, *self.steady_window
            )
        for route in ROUTES:
            key = route.replace("/v1/", "").replace("/", "_").replace("{id}", "id").strip("_")
            self.out[f"rest_{key}_p50_s"] = pct(latencies[route], 0.5)
            self.out[f"rest_{key}_p99_s"] = pct(latencies[route], 0.99)
            self.out[f"rest_{key}_n"] = len(latencies[route])
        self.out["rest_p99_s"] = max(
            (
                v
                for k, v in self.out.items()
                if k.startswith("rest_") and k.endswith("_p99_s") and v
            ),
            default=None,
        )

    def dashboard(self) -> None:
        """The dashboard's fleet page in headless chromium, under the fleet's load: from
        the page asked for (logged in) to a tile drawn for every node, ``--browser`` times
        (Debian's chromium and chromedriver, as tests/integration/test_dashboard.py)."""
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
        from selenium.webdriver.common.by import By

        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for arg in (
            "--headless=new",
            "--no-sandbox",
            "--disable-dev-shm-usage",
            "--disable-gpu",
            "--window-size=1400,1000",
            f"--user-data-dir={self.root / 'chromium'}",
        ):
            options.add_argument(arg)
        service = Service(
            executable_path="/usr/bin/chromedriver", log_output=str(self.root / "driver.log")
        )
        driver = webdriver.Chrome(options=options, service=service)
        url = f"http://127.0.0.1:{self.api_port}/ui/#/fleet"
        times = []
        try:
            driver.get(url)
            self.wait(lambda: driver.find_elements(By.ID, "token"), 30, "the login form")
            driver.find_element(By.ID, "token").send_keys(TOKEN)
            t0 = time.perf_counter()
            driver.find_element(By.ID, "login-submit").click()
            for i in range(self.args.browser):
                if i:
                    t0 = time.perf_counter()
                    driver.get("about:blank")
                    driver.get(url)
                self.wait(
                    lambda: len(driver.find_elements(By.CSS_SELECTOR, ".tile")) >= self.fleet,
                    120,
                    f"a tile for each of the {self.fleet} nodes",
                    interval=0.05,
                )
                times.append(round(time.perf_counter() - t0, 3))
        finally:
            driver.quit()
        self.out["dashboard_fleet_page_s"] = times
        self.out["dashboard_fleet_page_p50_s"] = pct(times, 0.5)

    def recovered(self, generation: int, t0: float, what: str) -> dict[str, Any]:
        """Wait until the job runs ``generation`` or a later one (a relaunch that failed,
        its start orders late at starved simulators, is recovered again) on all its
        nodes; the orders' times of the generation that ran, and how many launches it
        took (``launches``)."""

        def ran() -> bool:
            job = self.job()
            return job["state"] == "running" and job["generation"] >= generation

        self.wait(ran, 240, f"the job running generation {generation} or later after {what}")
        first, generation = generation, self.job()["generation"]
        self.wait(
            lambda: len(self.starts_of(generation)) >= self.job_nodes,
            120,
            f"every start order of generation {generation} after the {what}",
        )
        times = sorted(s["at"] - t0 for s in self.starts_of(generation))
        got: dict[str, Any] = {
            "at": round(t0, 3),  # the fault's wall clock time (the stalls' "at" compare)
            "first": round(times[0], 3),
            "last": round(times[-1], 3),
            "launches": generation - first + 1,
        }
        out = self.orders.of(self.job_id, generation) if self.orders is not None else []
        if len(out) >= self.job_nodes:  # every order seen leaving the broker (QoS 0 may drop)
            got["out"] = round(max(out) - t0, 3)
        # The supervisor's side of it, from the incident it recorded: when it knew of the
        # fault, how long it planned and sent the stops, when it began the launch.
        incidents = self.job()["incidents"]
        incident = next((i for i in incidents if i.get("next_generation") == generation), None)
        if incident is not None:
            got["supervisor"] = {
                "detected": round(incident["detected_at"] - t0, 3),
                "launch_began": round((incident["launch_started_at"] or t0) - t0, 3),
                "acked": round(incident["fault_at"] + (incident["acked_s"] or 0.0) - t0, 3),
                "phases": incident["phases"],
            }
        return got

    def faults(self) -> None:
        job = self.job()
        nodes = job["nodes"]
        faults: dict[str, Any] = {}
        for kind in self.args.faults.split(","):
            for _ in range(self.args.repeats):
                generation = self.job()["generation"]
                time.sleep(self.args.settle)
                self.progressed()
                victim = self.job()["nodes"][len(nodes) // 2]
                sim = self.owner[victim]
                t0 = time.time()
                if kind == "ecc":
                    sim.order(op="ecc", node=victim)
                elif kind == "node_lost":
                    sim.order(op="die", node=victim)
                    self.killed += 1
                elif kind == "hang":
                    sim.order(op="hang", node=victim, job=self.job_id)
                elif kind == "broker_restart":
                    if "lost_before_broker_restart" not in self.out:
                        self.out["lost_before_broker_restart"] = self.lost()[0]
                    faults.setdefault(kind, []).append(self.broker_restart(generation))
                    continue
                got = self.recovered(generation + 1, t0, kind)
                got["node"] = victim
                faults.setdefault(kind, []).append(got)
        self.out["faults"] = faults
        for kind, key in (
            ("node_lost", "node_lost_to_orders"),
            ("ecc", "ecc_to_orders"),
            ("hang", "hang_to_orders"),
        ):
            # Orders out: the last start order left the broker (else, when the watcher
            # missed one, received by the fleet); received: the last taken by its node.
            outs = [f.get("out", f["last"]) for f in faults.get(kind, [])]
            lasts = [f["last"] for f in faults.get(kind, [])]
            if lasts:
                self.out[f"{key}_p50_s"] = pct(outs, 0.5)
                self.out[f"{key}_p99_s"] = pct(outs, 0.99)
                self.out[f"{key}_received_p99_s"] = pct(lasts, 0.99)
                self.out[f"{key}_n"] = len(lasts)

    def progressed(self) -> None:
        """When two of the job's last three recoveries restored one step, wait for a newer
        checkpoint a replacement can read (at the peer or object tier): the next recovery
        could restore it a third time, and a fourth would fail the job (the planner's
        rule: no checkpoint progress). Faults a few seconds apart, as here, are no
        fleet's failure rate; at 2,048 nodes four fell within one 60 s checkpoint
        interval."""
        restored = [i.get("restored_step") for i in self.job()["incidents"][-NO_PROGRESS:]]
        steps = [s for s in restored if s is not None]
        if not steps or steps.count(max(steps)) < NO_PROGRESS - 1:
            return
        last = max(steps)

        def newer() -> bool:
            refs = (self.job().get("summary") or {}).get("checkpoints", [])
            return any(
                c["step"] > last and {"peer", "object"} & set(c.get("tiers", [])) for c in refs
            )

        self.wait(newer, 2 * self.args.ckpt_every + 60, f"a checkpoint after step {last}")

    def broker_restart(self, generation: int) -> dict[str, Any]:
        """Mosquitto stopped and started again on its port: every node and the supervisor
        reconnect; the job must go on (no recovery) and nothing may be lost."""
        assert self.broker is not None
        before = self.stats()["mqtt_connects"]
        t0 = time.time()
        self.broker.send_signal(signal.SIGTERM)
        self.broker.wait(20)
        self.start_broker()
        self.wait(lambda: self.stats()["mqtt_connects"] > before, 60, "the supervisor back")
        self.wait(lambda: self.nodes_online() >= self.fleet - self.killed, 120, "the fleet back")
        back = time.time() - t0
        time.sleep(3 * self.args.heartbeat)  # a node judged offline would show by now
        job = self.job()
        return {
            "fleet_back_s": round(back, 3),
            "job_state": job["state"],
            "recoveries": job["generation"] - generation,
        }

    def nodes_online(self) -> int:
        return sum(n["state"] != "offline" for n in self.api.get("/v1/nodes"))

    def lost(self) -> tuple[dict[str, int], list[dict[str, Any]], dict[str, int]]:
        """Once every outbox is empty: what was sent and not counted by the supervisor,
        by kind; the simulators' reports; what the supervisor counted. A message sent
        while this looked (a late recovery's rank events) is in flight, not lost: it is
        looked at again, up to three times, until no outbox holds anything and every
        rank event and landing sent was counted."""
        for _ in range(3):
            self.out.pop("outboxes_not_empty", None)  # what the last look saw
            self.out.pop("supervisor_behind", None)
            try:
                self.wait(
                    lambda: all(r["queued"] == 0 for r in self.reports()), 120, "outboxes empty"
                )
            except RuntimeError as exc:
                self.out["outboxes_not_empty"] = str(exc)
            time.sleep(2.0)  # metrics on their way
            try:  # and the supervisor through what it received (it may lag its broker)
                self.wait(
                    lambda: self.stats().get("behind_s", 0.0) == 0.0, 120, "supervisor caught up"
                )
            except RuntimeError as exc:
                self.out["supervisor_behind"] = str(exc)
            reports = self.reports()
            sent = {k: sum(r["sent"][k] for r in reports) for k in ("rank", "ckpt", "metrics")}
            # The nodes go on sending metrics: what they sent before the reports may still
            # be on its way (the broker, the sockets) when the supervisor is asked.
            deadline = time.monotonic() + 15.0
            while True:
                received = self.stats()["received"]
                got = {
                    "rank": received.get("rank", 0),
                    "ckpt": received.get("ckpt", 0) + received.get("ckpt_released", 0),
                    "metrics": received.get("metrics", 0),
                }
                lost = {k: max(0, sent[k] - got[k]) for k in sent}
                if not any(lost.values()) or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            if not any(r["queued"] for r in reports) and not lost["rank"] and not lost["ckpt"]:
                break
        self.out.update(sent=sent, received=got)
        return lost, reports, got

    def totals(self) -> None:
        """Every message sent against what the supervisor counted; the commit times."""
        for sim in self.sims:  # the metrics stop, so that what was sent is a fixed count
            sim.order(op="quiet")
        lost, reports, got = self.lost()
        sent = self.out["sent"]
        self.out.update(
            lost_by_kind=lost,
            lost_messages=sum(lost.values()),
            duplicates={k: max(0, got[k] - sent[k]) for k in sent},
            queued_at_end=sum(r["queued"] for r in reports),
            stuck_outboxes=[x for r in reports for x in r["stuck"]][:20],
            # Nodes whose ranks waited CATALOG_WAIT_S for their generation's catalog (the
            # supervisor sends it beside the start orders): restored from an older one, or
            # failed for want of any. Both should be 0.
            catalog_waits={
                k: sum(r.get("catalog_waits", {}).get(k, 0) for r in reports)
                for k in ("late", "none")
            },
        )
        # The simulators' own loops (each serves --per-process nodes): their nodes'
        # heartbeats, acks and landings wait behind these stalls before they are sent.
        sim_stalls = [s for r in reports for s in (r.get("loop") or {}).get("recent", [])]
        self.out["simulator_steady_loop_stalls"] = summarize(sim_stalls, *self.steady_window)
        self.out["simulator_loop_stalls"] = summarize(sim_stalls)
        last_landing: dict[int, float] = {}
        for r in reports:
            for job, step, at in r["last_landing"]:
                if job == self.job_id:
                    last_landing[step] = max(last_landing.get(step, 0.0), at)
        seen: dict[int, list[float]] = {}
        for r in reports:
            for job, step, times in r["catalogs"]:
                if job == self.job_id:
                    seen.setdefault(step, []).extend(times)
        commits, outs, outs_delivered = [], [], []
        steps: list[dict[str, Any]] = []
        for step, times in sorted(seen.items()):
            # The moment the job's last node had it (a spare that joins later sees old
            # steps for the first time then: those are not counted).
            if step in last_landing and len(times) >= self.job_nodes:
                commits.append(sorted(times)[self.job_nodes - 1] - last_landing[step])
                out = self.orders.catalogs_of(self.job_id, step) if self.orders else []
                if self.orders is None or len(out) < self.job_nodes:
                    continue  # the watcher did not see each (QoS 0 may drop)
                landed, last_out = last_landing[step], sorted(out)[self.job_nodes - 1]
                outs.append(last_out - landed)
                taken: dict[str, Any] = {"step": step}
                if (delivered := self.orders.landed.get((self.job_id, step))) is not None:
                    outs_delivered.append(last_out - delivered)
                    taken["landing_delivered_s"] = round(delivered - landed, 3)
                if self.stall_log is not None:
                    taken |= self.stall_log.commit_of(self.job_id, self.job_nodes, landed, last_out)
                    steps.append(taken)
        self.out["commit_steps"] = steps
        # Out: the job's last node's catalog saying so left the broker; received: taken by
        # its (simulated) node.
        self.out["commit_after_last_landing_s"] = pct(outs or commits, 0.5)
        self.out["commit_after_last_landing_max_s"] = max(outs or commits, default=None)
        # From the broker's delivery of the last landing (to the bench's watcher): the
        # supervisor's and the broker's share, not the starved simulators' send.
        self.out["commit_after_last_landing_delivered_s"] = pct(outs_delivered, 0.5)
        self.out["commit_after_last_landing_delivered_max_s"] = max(outs_delivered, default=None)
        self.out["commit_after_last_landing_received_s"] = pct(commits, 0.5)
        self.out["commit_after_last_landing_received_max_s"] = max(commits, default=None)
        self.out["commits_measured"] = len(commits)

    def run(self) -> dict[str, Any]:
        self.out.update(
            bench="fleet_scale",
            workload=self.args.workload,
            nodes=self.args.nodes,
            job_nodes=self.job_nodes,
            spares=self.args.spares,
            fleet_nodes=self.fleet,
            ranks=self.job_nodes * 8,  # the big job's (the small jobs' come and go)
            per_process=self.args.per_process,
            sim_nice=self.args.sim_nice,
            sim_processes=-(-self.fleet // self.args.per_process),
            cores=os.cpu_count(),
            fd_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[1],
        )
        t0 = time.time()
        self.start_broker()
        self.start_supervisor()
        self.stall_log = StallLog(self.api_port)
        self.start_fleet()
        self.out["fleet_up_s"] = round(time.time() - t0, 1)
        self.orders = OrderWatch(self.broker_port)
        self.submit()
        time.sleep(self.args.settle)
        self.steady()
        if self.args.browser:
            self.dashboard()
        if self.args.faults:
            self.faults()
        self.totals()
        if self.small:
            self.small_totals()
        assert self.supervisor is not None
        self.out["supervisor_alive"] = self.supervisor.poll() is None
        self.out["bad_messages"] = self.stats()["bad_messages"]
        assert self.stall_log is not None
        time.sleep(1.5)  # the stall log's last poll
        self.out["loop_stalls"] = self.stall_log.summary()
        self.out["gc_pauses"] = self.stall_log.gc_summary()
        self.out["fault_loop_stalls"] = [  # each of the faults' (after the steady state)
            {k: s.get(k) for k in ("at", "s", "cpu_s", "stack", "leaf")}
            for at, s in sorted(self.stall_log.stalls.items())
            if at >= self.steady_window[1]
        ][:200]
        return self.out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--nodes", type=int, default=2048, help="nodes of the job (mixed: of the fleet)"
    )
    ap.add_argument(
        "--spares", type=int, default=None, help="hot spares (default: 4 + 1%%; mixed: 5%%)"
    )
    ap.add_argument("--workload", choices=["big", "mixed"], default="big")
    ap.add_argument(
        "--small-jobs", type=int, default=None, help="mixed: small jobs (default: nodes / 8)"
    )
    ap.add_argument(
        "--small-steps", type=int, default=15, help="mixed: steps a small job takes (+0-9)"
    )
    ap.add_argument("--per-process", type=int, default=512, help="simulated agents a process")
    ap.add_argument("--heartbeat", type=float, default=5.0)
    ap.add_argument(
        "--offline-after",
        type=float,
        default=None,
        help="the supervisor's offline_after_s (default: 3 heartbeats, as deployed)",
    )
    ap.add_argument("--step", type=float, default=2.0, help="seconds per training step")
    ap.add_argument(
        "--no-batch-landings",
        dest="batch_landings",
        action="store_false",
        help="one message per landing and rank event, as agents before CkptLandings and "
        "RankEvents sent them",
    )
    ap.add_argument("--ckpt-every", type=float, default=60.0, help="seconds between checkpoints")
    ap.add_argument(
        "--sim-nice",
        type=int,
        default=10,
        help="the simulators' nice value: on a fleet they are other machines; here they "
        "must not take the supervisor's core by fair share (0: as equals)",
    )
    ap.add_argument("--steady", type=float, default=90.0, help="seconds of steady state measured")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds before each fault")
    ap.add_argument("--rest-every", type=float, default=1.0)
    ap.add_argument(
        "--browser",
        type=int,
        default=0,
        help="load the dashboard's fleet page in headless chromium this many times, after "
        "the steady state (0: not)",
    )
    ap.add_argument("--faults", default="ecc,node_lost,hang,broker_restart")
    ap.add_argument("--repeats", type=int, default=1, help="times each fault is injected")
    ap.add_argument("--profile", help="record the supervisor with py-spy (raw) to this file")
    ap.add_argument("--keep", action="store_true", help="keep the run's folder (logs, store)")
    args = ap.parse_args()
    if args.spares is None:
        args.spares = (
            max(1, args.nodes // 20) if args.workload == "mixed" else 4 + args.nodes // 100
        )
    if args.small_jobs is None:
        args.small_jobs = max(8, args.nodes // 8)
    raise_fd_limit()
    root = Path(tempfile.mkdtemp(prefix="phalanx-scale-"))
    bench = Bench(args, root)
    try:
        out = bench.run()
    except (RuntimeError, ApiError) as exc:  # what was measured so far still counts
        out = {**bench.out, "error": str(exc)}
        print(json.dumps(out, indent=2))
        raise
    finally:
        bench.stop()
        if not args.keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
    out["folder"] = str(root) if args.keep else None
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
