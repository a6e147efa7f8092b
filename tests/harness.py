"""Real parts for integration tests: a Mosquitto broker, daemons as processes, a cuttable link.

Everything listens on loopback, on ports picked free at start, and is stopped
by the fixtures that start it.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from phalanx.agent_tokens import node_token
from phalanx.certs import Authority, make_authority
from phalanx.client import ApiError, Client
from phalanx.local import agent_toml, find_mosquitto, free_port, write_mosquitto_conf

T = TypeVar("T")
TOKEN = "test-token-0123456789abcdef"


def wait_for(
    predicate: Callable[[], T | None], timeout: float, what: str, interval: float = 0.05
) -> T:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
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
    raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}; last: {last!r}")


class Process:
    """One daemon as a child process in its own process group, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
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

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGCONT)
                os.killpg(self.pid, signal.SIGTERM)
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
            try:
                wait_for(
                    lambda p=port: _listening(p) or (not self._alive() and "exited"),
                    10,
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


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            return True
    except OSError:
        return False


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
        self.api_port = 0
        self.agents: dict[str, Process] = {}
        self.links: list[CuttableLink] = []
        # The agents' RAM tier, in a tmpfs folder of this test's own, removed at stop.
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else root
        self.shm_dir = base / f"phalanx-test-{os.getpid()}-{id(self):x}"
        self.shm_dir.mkdir(parents=True, exist_ok=True)

    def start_supervisor(
        self,
        *,
        offline_after_s: float = 4.0,
        keepalive_s: int = 5,
        spares: int = 0,
        extra: str = "",
        mqtt: str = "",
    ) -> Process:
        """``extra`` goes at the top level of the config, ``mqtt`` in its ``[mqtt]``."""
        self.api_port = self.api_port or free_port()
        directory = self.root / "supervisor"
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
            f'agent_token_file = "{self.agent_secret_file()}"\nschedule_interval_s = 0.5\n'
            f"spares = {spares}\n{tls_top}{extra}"
            f"[mqtt]\nport = {self.broker.port}\nkeepalive_s = {keepalive_s}\n"
            f"reconnect_max_s = 1.0\n{mqtt}"
            f'[api]\nport = {self.api_port}\ntoken_file = "{directory / "token"}"\n{tls_api}'
        )
        self.supervisor = Process(
            "supervisor",
            [sys.executable, "-m", "supervisor", "--config", str(conf)],
            self.root / "logs" / "supervisor.log",
        ).start()
        wait_for(lambda: _listening(self.api_port) or None, 20, "the supervisor API")
        return self.supervisor

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
        ).start()
        self.agents[node] = agent
        return agent

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
        base: dict[str, Any] = {"team": "research", "workdir": str(self.root)}
        job: dict[str, Any] = self.client().post("/v1/jobs", {"spec": {**base, **spec}})
        return job

    def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.client().get(f"/v1/jobs/{job_id}")
        return result

    def wait_job(self, job_id: str, state: str, timeout: float = 60.0) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            view = self.job(job_id)
            return view if view["state"] == state else None

        return wait_for(check, timeout, f"job {job_id} to be {state}", interval=0.1)

    def sim_file(self, node: str) -> Path:
        return self.root / "nodes" / node / "data" / "sim-gpus.json"

    @property
    def api_url(self) -> str:
        return f"{'https' if self.authority else 'http'}://127.0.0.1:{self.api_port}"

    def cli_env(self) -> dict[str, str]:
        """What points the CLI at this fleet: PHALANX_API, PHALANX_TOKEN (and PHALANX_CA)."""
        env = {"PHALANX_API": self.api_url, "PHALANX_TOKEN": TOKEN}
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
        return Client(self.api_url, TOKEN, timeout=5, ca_file=ca)

    def node(self, node: str) -> dict[str, Any]:
        result: dict[str, Any] = self.client().get(f"/v1/nodes/{node}")
        return result

    def wait_state(self, node: str, state: str, timeout: float = 15.0) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            view = self.node(node)
            return view if view["state"] == state else None

        return wait_for(check, timeout, f"node {node} to be {state}")

    def stop(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        if self.supervisor is not None:
            self.supervisor.stop()
        for link in self.links:
            link.close()
        shutil.rmtree(self.shm_dir, ignore_errors=True)


class RawMqtt:
    """A plain paho client for tests that speak MQTT directly (garbage, raw commands)."""

    def __init__(self, port: int, *, auth: tuple[str, str] | None = None) -> None:
        """``auth``: the user and password to connect as, where the broker wants one."""
        import paho.mqtt.client as mqtt

        self.messages: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
        self.client.on_message = self._on_message
        if auth is not None:
            self.client.username_pw_set(*auth)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        with self._lock:
            self.messages.append((message.topic, bytes(message.payload)))

    def subscribe(self, topic: str) -> None:
        result, _mid = self.client.subscribe(topic, qos=1)
        assert result == 0

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


def processes_matching(marker: str) -> list[int]:
    """Pids of live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if marker in cmdline and state != "Z" and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    return found


def rank_pid(
    job: str, rank: int, *, generation: int | None = None, marker: str = "examples/tinylm.py"
) -> int | None:
    """The pid of a live rank process of ``job`` (its command line holds ``marker``),
    read from its environment; of ``generation`` only, when given."""
    for pid in processes_matching(marker):
        try:
            env = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                if "=" in item
            )
        except OSError:
            continue
        if (
            env.get("PHALANX_JOB_ID") == job
            and env.get("RANK") == str(rank)
            and (generation is None or env.get("PHALANX_GENERATION") == str(generation))
        ):
            return pid
    return None
