"""Real parts for integration tests: a Mosquitto broker, daemons as processes, a cuttable link.

Everything listens on loopback, on ports picked free at start, and is stopped
by the fixtures that start it. Tests may run side by side (pytest-xdist): nothing here
is shared between two tests (see also ``tests.processes``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from phalanx.agent_tokens import node_token
from phalanx.certs import Authority, make_authority
from phalanx.client import ApiError, Client
from phalanx.local import (
    LOCAL_MIN_P2P,
    LOCAL_PROBE_BYTES,
    agent_toml,
    find_mosquitto,
    free_port,
    write_mosquitto_conf,
)
from tests.processes import FLEET_ENV, processes_marked
from tests.processes import processes_matching as processes_matching
from tests.processes import rank_pid as rank_pid
from tests.wait import wait_for as wait_for

TOKEN = "test-token-0123456789abcdef"


def leader_of(url: str) -> dict[str, Any] | None:
    """``GET /v1/leader`` of the one supervisor at ``url`` (a standby answers it too):
    whether it leads, and who does; None when it does not answer."""
    try:
        view: dict[str, Any] = Client(url, TOKEN, timeout=2).get("/v1/leader")
    except ApiError:
        return None
    return view


class Process:
    """One daemon as a child process in its own process group, its output in a log file."""

    def __init__(
        self, name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None
    ) -> None:
        """``env``: variables added to this process's environment."""
        self.name = name
        self.cmd = cmd
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self._terminated = False

    def start(self) -> Process:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._terminated = False
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **self.env} if self.env else None,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.pid, sig)

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM, after a SIGCONT in case it was stopped) once: a second
        SIGTERM would make a daemon exit at once. `stop` waits."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self._terminated = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGCONT)
                os.killpg(self.pid, signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Broker:
    """A real Mosquitto on a free loopback port; restartable on the same port."""

    def __init__(self, directory: Path, *, conf_extra: str = "") -> None:
        """``conf_extra``: more lines for its mosquitto.conf (a password file, say)."""
        binary = find_mosquitto()
        if binary is None:
            raise RuntimeError("these tests need Mosquitto: apt-get install -y mosquitto")
        self.binary = binary
        self.directory = directory
        self.conf_extra = conf_extra
        self.port = 0
        self.process: Process | None = None

    def start(self) -> Broker:
        for _ in range(5):
            port = self.port or free_port()
            conf = self.directory / "mosquitto.conf"
            write_mosquitto_conf(conf, port, extra=self.conf_extra)
            self.process = Process(
                "broker", [self.binary, "-c", str(conf)], self.directory / "broker.log"
            ).start()
            # Its own process listening, not just anything on the port: a broker of a test
            # beside this one that took the port in the meantime does not count.
            try:
                wait_for(
                    lambda p=port: _owns_port(self.process, p) or (not self._alive() and "exited"),
                    30,
                    f"mosquitto on port {port}",
                )
            except AssertionError:
                self.process.stop()
                raise
            if self._alive():
                self.port = port
                return self
            if self.port:  # a fixed port is taken: report it
                raise RuntimeError(
                    f"mosquitto could not bind port {port}: {self.process.output()[-500:]}"
                )
        raise RuntimeError("mosquitto could not find a free port")

    def _alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()


def _ports(process: Process | None) -> set[int]:
    """The TCP ports ``process`` listens on (none once it ended)."""
    if process is None or not process.alive():
        return set()
    try:
        connections = psutil.Process(process.pid).net_connections(kind="tcp")
    except psutil.Error:
        return set()
    return {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}


def _owns_port(process: Process | None, port: int) -> bool:
    return port in _ports(process)


def _api_port(process: Process) -> int | None:
    """The port ``process`` listens on once it does; it ending first fails the test."""
    if not process.alive():
        raise AssertionError(f"{process.name} exited: {process.output()[-2000:]}")
    ports = _ports(process)
    return ports.pop() if len(ports) == 1 else None


class CuttableLink:
    """A TCP relay between an agent and the broker whose traffic can be frozen.

    ``cut()`` stops moving bytes in both directions without closing anything:
    a partition, not a crash, so the broker sends no last will until its
    keepalive runs out. ``heal()`` lets the held bytes through again.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._frozen = threading.Event()
        self._stop = threading.Event()
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen()
        self._server.settimeout(0.2)
        self.port = int(self._server.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def cut(self) -> None:
        self._frozen.set()

    def heal(self) -> None:
        self._frozen.clear()

    def drop(self) -> None:
        """End every connection relayed so far (a broker restart, as its clients see it);
        new ones are still accepted."""
        sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._stop.set()
        self._frozen.clear()
        for s in [self._server, *self._sockets]:
            with contextlib.suppress(OSError):
                s.close()
        self._thread.join(2)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), 2)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                data = src.recv(65536)
                if not data:
                    break
                while self._frozen.is_set() and not self._stop.is_set():
                    time.sleep(0.02)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


class Fleet:
    """Broker + supervisor + agents for one test, each a real process. With ``tls`` every
    HTTP hop is HTTPS: a throw-away CA (``authority``, as ``phalanx local up --tls`` makes)
    signs the API's and each agent's certificate (IP SAN 127.0.0.1)."""

    def __init__(self, root: Path, broker: Broker, *, tls: bool = False) -> None:
        self.root = root
        self.broker = broker
        self.authority: Authority | None = make_authority(root / "tls") if tls else None
        self.supervisor: Process | None = None
        self.standbys: list[Process] = []  # more supervisors (start_supervisor's name)
        self.api_port = 0
        self.api_urls: list[str] = []  # the API URLs the client tries (empty: api_url)
        self.agents: dict[str, Process] = {}
        self.links: list[CuttableLink] = []
        # The agents' RAM tier, in a tmpfs folder of this test's own, removed at stop.
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else root
        self.shm_dir = base / f"phalanx-test-{os.getpid()}-{id(self):x}"
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        self.mark = {FLEET_ENV: uuid.uuid4().hex}

    def start_supervisor(
        self,
        *,
        offline_after_s: float = 4.0,
        keepalive_s: int = 5,
        spares: int = 0,
        extra: str = "",
        mqtt: str = "",
        sections: str = "",
        name: str = "supervisor",
        api_port: int | None = None,
    ) -> Process:
        """``extra`` goes at the top level of the config, ``mqtt`` in its ``[mqtt]``,
        ``sections`` (whole sections: ``[store]``, ``[ha]``) at its end.

        The first start binds a port the kernel picks (no window in which a test beside
        this one could take it) and reads it back; a restart keeps that port. A second
        supervisor (a standby, ``name`` and ``api_port`` its own) is not the fleet's
        ``supervisor``: the test keeps it."""
        standby = name != "supervisor"
        directory = self.root / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "token").write_text(TOKEN)
        conf = directory / "supervisor.toml"
        tls_top, tls_api = "", ""
        if self.authority is not None:
            files = self.authority.issue("supervisor")
            tls_top = f'agent_tls = true\nagent_ca_file = "{self.authority.ca}"\n'
            tls_api = f'tls_cert_file = "{files.cert}"\ntls_key_file = "{files.key}"\n'
        conf.write_text(
            f'state_dir = "{directory / "state"}"\noffline_after_s = {offline_after_s}\n'
            # loopback links share the machine's CPUs (phalanx.local's reasoning)
            f"screen_probe_bytes = {LOCAL_PROBE_BYTES}\nscreen_min_p2p = {LOCAL_MIN_P2P}\n"
            f'agent_token_file = "{self.agent_secret_file()}"\nschedule_interval_s = 0.5\n'
            f"spares = {spares}\n{tls_top}{extra}"
            f"[mqtt]\nport = {self.broker.port}\nkeepalive_s = {keepalive_s}\n"
            f"reconnect_max_s = 1.0\n{mqtt}"
            f"[api]\nport = {self.api_port if api_port is None else api_port}\n"
            f'token_file = "{directory / "token"}"\n{tls_api}{sections}'
        )
        supervisor = Process(
            name,
            [sys.executable, "-m", "supervisor", "--config", str(conf)],
            self.root / "logs" / f"{name}.log",
            self.mark,
        ).start()
        if standby:
            self.standbys.append(supervisor)
        else:
            self.supervisor = supervisor  # stopped by stop() even if it never serves
        # Generous: a daemon's start (its imports) takes long on a busy machine.
        port = wait_for(lambda: _api_port(supervisor), 60, f"the {name} API")
        if not standby:
            self.api_port = port
        return supervisor

    def start_agent(
        self,
        node: str,
        *,
        gpus: int = 2,
        heartbeat_s: float = 1.0,
        keepalive_s: int = 5,
        via: CuttableLink | None = None,
        extra: str = "",
        rack: str = "rack1",
        top: str = "",
        mqtt: str = "",
        xid_hold_s: float = 30.0,
    ) -> Process:
        """``extra`` goes at the end of the config (in its last section, ``[ckpt]``);
        ``top`` at its start, for top-level settings; ``mqtt`` in its ``[mqtt]``."""
        directory = self.root / "nodes" / node
        directory.mkdir(parents=True, exist_ok=True)
        port = via.port if via is not None else self.broker.port
        conf = directory / "agentd.toml"
        text = agent_toml(
            node,
            directory / "data",
            port,
            gpus,
            rack=rack,
            heartbeat_s=heartbeat_s,
            token_file=self.agent_token_file(node),
            object_store=self.root / "objects",
            tls=self.authority.issue(node) if self.authority else None,
            ca=self.authority.ca if self.authority else None,
            xid_hold_s=xid_hold_s,
        )
        text += f'shm_dir = "{self.shm_dir}"\n'  # in the [ckpt] section agent_toml ends with
        text = text.replace(
            "keepalive_s = 5", f"keepalive_s = {keepalive_s}\nreconnect_max_s = 1.0\n{mqtt}"
        )
        conf.write_text(top + text + extra)
        agent = Process(
            f"agent-{node}",
            [sys.executable, "-m", "agentd", "--config", str(conf)],
            self.root / "logs" / f"agent-{node}.log",
            self.mark,
        ).start()
        self.agents[node] = agent
        return agent

    def start_nodes(self, count: int, *, racks: int = 1, **agent: Any) -> list[str]:
        """Agents ``n01`` .. (node i in rack ``i % racks + 1``; ``agent``: `start_agent`'s
        settings), each waited for until the supervisor has it up. Their names."""
        nodes = [f"n{i + 1:02d}" for i in range(count)]
        for i, node in enumerate(nodes):
            self.start_agent(node, rack=f"rack{i % racks + 1}", **agent)
        for node in nodes:
            self.wait_state(node, "up", timeout=60)  # an agent's start: see start_supervisor
        return nodes

    def agent_secret_file(self) -> Path:
        """The fleet agent secret: the supervisor's ``agent_token_file``."""
        path = self.root / "agent-secret"
        if not path.exists():
            path.write_text("agent-secret-0123456789abcdef")
            path.chmod(0o600)
        return path

    def agent_token_file(self, node: str) -> Path:
        """Node ``node``'s own agent token (its ``http.token_file``), derived from the
        fleet secret as the Ansible role and ``phalanx local up`` derive it."""
        path = self.root / "nodes" / node / "agent-token"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            secret = self.agent_secret_file().read_text().strip()
            path.write_text(node_token(secret, node) + "\n")
            path.chmod(0o600)
        return path

    def submit(self, **spec: Any) -> dict[str, Any]:
        """Submit the job ``spec``; its view. Without warm interpreters unless the spec asks
        for them (``restart.warm``, on by default for a user): each imports torch (~4.5 s
        of a core here) behind every rank slot, on every spare, and again once it became
        a rank; an integration run started 219 of them, mostly for tests not about them."""
        base: dict[str, Any] = {"team": "research", "workdir": str(self.root)}
        restart = dict(spec.pop("restart", None) or {})
        restart.setdefault("warm", False)
        body = {"spec": {**base, **spec, "restart": restart}}
        job: dict[str, Any] = self.client().post("/v1/jobs", body)
        return job

    def run_job(
        self, state: str = "succeeded", timeout: float = 120.0, **spec: Any
    ) -> dict[str, Any]:
        """Submit the job ``spec`` and wait until it is ``state``; its view then."""
        return self.wait_job(self.submit(**spec)["id"], state, timeout)

    def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.client().get(f"/v1/jobs/{job_id}")
        return result

    def wait_job(self, job_id: str, state: str, timeout: float = 60.0) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            view = self.job(job_id)
            return view if view["state"] == state else None

        return wait_for(check, timeout, f"job {job_id} to be {state}", interval=0.1)

    def wait_generation(
        self, job_id: str, generation: int, timeout: float = 60.0
    ) -> dict[str, Any]:
        """Wait until the job runs generation ``generation`` (a recovery's relaunch); its
        view then."""

        def check() -> dict[str, Any] | None:
            view = self.job(job_id)
            running = view["state"] == "running" and view["generation"] == generation
            return view if running else None

        return wait_for(
            check, timeout, f"job {job_id} to run generation {generation}", interval=0.1
        )

    def sim_file(self, node: str) -> Path:
        return self.root / "nodes" / node / "data" / "sim-gpus.json"

    @property
    def api_url(self) -> str:
        return f"{'https' if self.authority else 'http'}://127.0.0.1:{self.api_port}"

    def cli_env(self) -> dict[str, str]:
        """What points the CLI at this fleet: PHALANX_API, PHALANX_TOKEN (and PHALANX_CA)."""
        env = {"PHALANX_API": ",".join(self.api_urls) or self.api_url, "PHALANX_TOKEN": TOKEN}
        if self.authority is not None:
            env["PHALANX_CA"] = str(self.authority.ca)
        return env

    def cli(
        self, *args: str, timeout: float = 300.0, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """``phalanx ARGS`` pointed at this fleet (``env``: more variables), its output text."""
        return subprocess.run(
            [sys.executable, "-m", "phalanx.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **self.cli_env(), **env},
        )

    def client(self) -> Client:
        ca = self.authority.ca if self.authority else None
        return Client(",".join(self.api_urls) or self.api_url, TOKEN, timeout=5, ca_file=ca)

    def node(self, node: str) -> dict[str, Any]:
        result: dict[str, Any] = self.client().get(f"/v1/nodes/{node}")
        return result

    def wait_state(self, node: str, state: str, timeout: float = 30.0) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            view = self.node(node)
            return view if view["state"] == state else None

        return wait_for(check, timeout, f"node {node} to be {state}")

    def wait_heartbeats(self, count: int, timeout: float = 30.0) -> None:
        """Wait until the supervisor has heard ``count`` heartbeats more (of all its nodes
        together) than it had when called."""

        def heard() -> int:
            return int(self.client().get("/v1/stats")["heartbeats"])

        start = heard()
        wait_for(lambda: heard() >= start + count, timeout, f"{count} more heartbeats")

    def stop(self) -> None:
        daemons = [
            *self.agents.values(),
            *([self.supervisor] if self.supervisor else []),
            *self.standbys,
        ]
        for daemon in daemons:  # all asked at once, then each waited for
            daemon.terminate()
        for daemon in daemons:
            daemon.stop()
        for pid in processes_marked(self.mark):  # orphaned ranks
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for link in self.links:
            link.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)


class RawMqtt:
    """A plain paho client for tests that speak MQTT directly (garbage, raw commands).

    It is connected once made, and subscribed once `subscribe` returns (the broker's
    CONNACK and SUBACK are waited for), so nothing published after that can be missed."""

    def __init__(self, port: int, *, auth: tuple[str, str] | None = None) -> None:
        """``auth``: the user and password to connect as, where the broker wants one."""
        import paho.mqtt.client as mqtt

        self.messages: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._refused: Any = None
        self._subscribed: set[int] = set()
        self._suback = threading.Condition(self._lock)
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_message = self._on_message
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        if auth is not None:
            self.client.username_pw_set(*auth)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        if not self._connected.wait(10):
            self.close()
            raise AssertionError(f"no CONNACK from the broker on port {port} in 10 s")
        if self._refused is not None:
            self.close()
            raise AssertionError(f"the broker on port {port} refused: {self._refused}")

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            self._refused = reason
        self._connected.set()

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        with self._suback:
            self._subscribed.add(mid)
            self._suback.notify_all()

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        with self._lock:
            self.messages.append((message.topic, bytes(message.payload)))

    def subscribe(self, topic: str) -> None:
        """Subscribe and wait for the broker's SUBACK."""
        result, mid = self.client.subscribe(topic, qos=1)
        assert result == 0
        with self._suback:
            if not self._suback.wait_for(lambda: mid in self._subscribed, 10):
                raise AssertionError(f"no SUBACK for {topic} in 10 s")

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until what the broker sent before now has arrived (the retained messages of
        the topics subscribed, say): a message of its own, sent through the broker to
        itself, comes after them."""
        topic = f"test/sync/{uuid.uuid4().hex}"
        self.subscribe(topic)
        self.publish(topic, b"sync")
        wait_for(lambda: self.received(topic), timeout, "a message to itself", interval=0.01)

    def publish(self, topic: str, payload: bytes | str, *, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(5)

    def received(self, topic: str) -> list[bytes]:
        with self._lock:
            return [p for t, p in self.messages if t == topic]

    def heard(self) -> list[tuple[str, bytes]]:
        """Every message received so far, as (topic, payload)."""
        with self._lock:
            return list(self.messages)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
