"""A throw-away fleet tree for the rollout tests: a CA, an inventory of local hosts, ansible runs.

Every host of the inventory is this machine (``ansible_connection: local``) with its own
``phalanx_root`` under a temporary directory, so the roles install into that prefix and never
touch /etc, /opt or systemd.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from phalanx.certs import Issued, make_authority
from phalanx.client import ApiError, Client

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
BIN = Path(sys.executable).parent

API_TOKEN = "rollout-test-token-0123456789"
SUPERVISOR_PASSWORD = "supervisor-secret-5f1c"
AGENT_HTTP_TOKEN = "agent-http-token-93ab"
OBJECT_STORE = "file:///srv/phalanx-objects"
OBJECT_STORE_ENV = {
    "AWS_ENDPOINT_URL": "https://s3.test",
    "AWS_SECRET_ACCESS_KEY": "s3-secret-5e1f",
}
NODE_PASSWORDS = {"gpu-a01": "gpu-a01-secret-77d2", "gpu-a02": "gpu-a02-secret-0c4e"}


def tool(name: str) -> str:
    """A console script of the interpreter running the tests (ansible-playbook, ansible-lint)."""
    return str(BIN / name)


def ansible_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "PHALANX_"))}
    (home / "tmp-files").mkdir(parents=True, exist_ok=True)
    env |= {
        "TMPDIR": str(home / "tmp-files"),  # where modules' temporary files go
        "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    }
    return env


def run_playbook(
    playbook: str, inventory: Path, home: Path, *args: str, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("ansible-playbook"), "-i", str(inventory), playbook, *args],
        cwd=ANSIBLE,
        env=ansible_env(home),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP of ansible-playbook's output: host -> {ok, changed, failed, ...}."""
    hosts: dict[str, dict[str, int]] = {}
    for line in output.split("PLAY RECAP", 1)[-1].splitlines():
        m = re.match(r"^(\S+)\s*:\s*(.*)$", line.strip())
        if m and "=" in m.group(2):
            hosts[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return hosts


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Pki:
    ca: Path
    cert: Path  # the broker's
    key: Path
    http: dict[str, Issued]  # each HTTP server's certificate (supervisor, agents), by host


HTTP_HOSTS = ("sup1", "gpu-a01", "gpu-a02")


def make_pki(directory: Path) -> Pki:
    """A throw-away CA (``phalanx.certs``, as ``phalanx local up --tls`` makes), a broker
    certificate and one HTTP certificate per supervisor and agent host, all for 127.0.0.1
    and localhost."""
    authority = make_authority(directory)
    broker = authority.issue("server")
    return Pki(authority.ca, broker.cert, broker.key, {h: authority.issue(h) for h in HTTP_HOSTS})


def write_inventory(
    path: Path,
    root: Path,
    pki: Pki,
    *,
    broker_port: int,
    api_port: int,
    agent_http_port: int,
    extra_agent_vars: dict[str, Any] | None = None,
) -> None:
    """broker1, sup1 and agents gpu-a01, gpu-a02 (a spare), each under ``root/<host>``."""
    agent_common = {
        "phalanx_agent_gpu_backend": "sim",
        "phalanx_agent_gpu_settings": {"sim_gpus": 2, "sample_interval_s": 0.5},
        # The test machine's disk, memory and load are not what this test is about.
        "phalanx_agent_thresholds": {
            "disk_drain_bytes": 0,
            "disk_warn_fraction": 0.0,
            "mem_warn_fraction": 0.0,
            "load_warn_per_cpu": 1000.0,
        },
        "phalanx_agent_http_host": "127.0.0.1",
        "phalanx_agent_address": "127.0.0.1",
        "phalanx_agent_ckpt_settings": {"object_store": OBJECT_STORE},
    } | (extra_agent_vars or {})

    def http_tls(host: str) -> dict[str, str]:
        return {
            "phalanx_http_tls_cert_file": str(pki.http[host].cert),
            "phalanx_http_tls_key_file": str(pki.http[host].key),
        }

    inventory = {
        "all": {
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "phalanx_python": sys.executable,
                "phalanx_broker_host": "127.0.0.1",
                "phalanx_broker_port": broker_port,
                "phalanx_tls_ca_file": str(pki.ca),
                "phalanx_supervisor_mqtt_password": SUPERVISOR_PASSWORD,
                "phalanx_api_token": API_TOKEN,
                "phalanx_agent_http_token": AGENT_HTTP_TOKEN,
                # Every HTTP hop over TLS, with the broker's CA.
                "phalanx_http_tls": True,
                "phalanx_supervisor_api_url": f"https://127.0.0.1:{api_port}",
                "phalanx_supervisor_api_ca_path": str(pki.ca),
                "phalanx_no_log": False,
            },
            "children": {
                "brokers": {
                    "hosts": {
                        "broker1": {
                            "phalanx_root": str(root / "broker1"),
                            "phalanx_broker_listen_address": "127.0.0.1",
                            "phalanx_broker_tls_cert_file": str(pki.cert),
                            "phalanx_broker_tls_key_file": str(pki.key),
                            # The test's Mosquitto runs as root, not as `mosquitto`.
                            "phalanx_broker_run_user": "root",
                        }
                    }
                },
                "supervisors": {
                    "hosts": {
                        "sup1": {
                            "phalanx_root": str(root / "sup1"),
                            "phalanx_supervisor_api_port": api_port,
                            "phalanx_supervisor_offline_after_s": 5,
                        }
                        | http_tls("sup1")
                    }
                },
                "agents": {
                    "hosts": {
                        "gpu-a01": agent_common
                        | {
                            "phalanx_root": str(root / "gpu-a01"),
                            "phalanx_rack": "r1",
                            "phalanx_nvlink_domain": "nvl72-1",
                            "phalanx_agent_http_port": agent_http_port,
                            "phalanx_agent_mqtt_password": NODE_PASSWORDS["gpu-a01"],
                            "phalanx_agent_object_store_env": OBJECT_STORE_ENV,
                        }
                        | http_tls("gpu-a01"),
                        "gpu-a02": agent_common
                        | {
                            "phalanx_root": str(root / "gpu-a02"),
                            "phalanx_rack": "r1",
                            "phalanx_spare": True,
                            "phalanx_agent_mqtt_password": NODE_PASSWORDS["gpu-a02"],
                        }
                        | http_tls("gpu-a02"),
                    }
                },
            },
        }
    }
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))


CONVERGE_LIMIT = "localhost,broker1,sup1,gpu-a01"


@dataclass
class FleetTree:
    """The first converge: where everything went and what ansible said."""

    root: Path
    inventory: Path
    ansible_home: Path
    build_dir: Path
    pki: Pki
    broker_port: int
    api_port: int
    agent_http_port: int
    first: subprocess.CompletedProcess[str]

    def host(self, name: str) -> Path:
        return self.root / "hosts" / name

    def converge(self, playbook: str = "site.yml", *args: str) -> subprocess.CompletedProcess[str]:
        return run_playbook(
            playbook,
            self.inventory,
            self.ansible_home,
            "--limit",
            CONVERGE_LIMIT,
            "-e",
            f"phalanx_build_dir={self.build_dir}",
            *args,
        )


class Daemon:
    """A process started by a fixture, in its own session, its output in a log file."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = log
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PHALANX_", "NOTIFY_SOCKET", "WATCHDOG_"))
        }
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.2):
            return True
    except OSError:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, *daemons: Daemon) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for daemon in daemons:
            if not daemon.alive():
                raise AssertionError(f"{what}: {daemon.log.name} exited:\n{daemon.output()}")
        try:
            if predicate():
                return
        except (ApiError, OSError):
            pass
        time.sleep(0.1)
    logs = "\n".join(f"--- {d.log.name}\n{d.output()}" for d in daemons)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")


@dataclass
class LiveFleet:
    supervisor: Daemon
    agent: Daemon
    client: Client
