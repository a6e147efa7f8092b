"""Both daemons speak sd_notify as systemd runs them: READY once serving, WATCHDOG, STOPPING.

Real daemons as processes, a real Mosquitto, and the test in systemd's place
at the other end of ``$NOTIFY_SOCKET`` (no systemd runs in the test container).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.local import free_port
from tests.harness import TOKEN, Broker, wait_for
from tests.rollout.notify_socket import NotifySocket

WATCHDOG_USEC = 300_000  # 0.3 s: the daemon pets every 0.15 s


def _start(cmd: list[str], log: Path, notify: NotifySocket) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env |= {"NOTIFY_SOCKET": notify.address, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    with log.open("ab") as out:
        return subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )


@pytest.fixture
def supervisor(
    tmp_path: Path, broker: Broker, notify_socket: NotifySocket
) -> Iterator[subprocess.Popen[bytes]]:
    (tmp_path / "token").write_text(TOKEN)
    conf = tmp_path / "supervisor.toml"
    conf.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[mqtt]\nport = {broker.port}\n'
        f'[api]\nport = {free_port()}\ntoken_file = "{tmp_path / "token"}"\n'
    )
    proc = _start(
        [sys.executable, "-m", "supervisor", "--config", str(conf)],
        tmp_path / "supervisor.log",
        notify_socket,
    )
    yield proc
    _stop(proc)


@pytest.fixture
def agent(
    tmp_path: Path, broker: Broker, notify_socket: NotifySocket
) -> Iterator[subprocess.Popen[bytes]]:
    conf = tmp_path / "agentd.toml"
    conf.write_text(
        f'node_id = "n01"\naddress = "127.0.0.1"\ndata_dir = "{tmp_path / "data"}"\n'
        f'[mqtt]\nport = {broker.port}\n[http]\nhost = "127.0.0.1"\nport = 0\n'
        '[gpu]\nbackend = "sim"\nsim_gpus = 2\n'
        "[thresholds]\ndisk_drain_bytes = 0\ndisk_warn_fraction = 0.0\n"
    )
    proc = _start(
        [sys.executable, "-m", "agentd", "--config", str(conf)],
        tmp_path / "agent.log",
        notify_socket,
    )
    yield proc
    _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)


def _ready(notify: NotifySocket, proc: subprocess.Popen[bytes] | None = None) -> list[str]:
    if proc is not None and proc.poll() is not None:
        raise AssertionError(f"the daemon exited with {proc.returncode}; see its log")
    return [m for m in notify.messages() if m.startswith("READY=1")]


def test_supervisor_says_ready_once_its_api_serves(
    supervisor: subprocess.Popen[bytes], notify_socket: NotifySocket
) -> None:
    ready = wait_for(lambda: _ready(notify_socket, supervisor), 20, "READY=1 from the supervisor")

    assert ready[0].startswith("READY=1\nSTATUS=serving: API on port ")


def test_supervisor_pets_the_watchdog_while_running(
    supervisor: subprocess.Popen[bytes], notify_socket: NotifySocket
) -> None:
    wait_for(lambda: _ready(notify_socket, supervisor), 20, "READY=1 from the supervisor")

    wait_for(lambda: len(notify_socket.arrivals("WATCHDOG=1")) >= 3, 5, "three watchdog pets")


def test_supervisor_says_stopping_on_sigterm_and_exits_cleanly(
    supervisor: subprocess.Popen[bytes], notify_socket: NotifySocket, tmp_path: Path
) -> None:
    wait_for(lambda: _ready(notify_socket, supervisor), 20, "READY=1 from the supervisor")

    supervisor.send_signal(signal.SIGTERM)

    assert supervisor.wait(15) == 0, (tmp_path / "supervisor.log").read_text()[-2000:]
    assert "STOPPING=1\nSTATUS=SIGTERM received: shutting down" in notify_socket.messages()


def test_agent_says_ready_once_it_serves(
    agent: subprocess.Popen[bytes], notify_socket: NotifySocket
) -> None:
    ready = wait_for(lambda: _ready(notify_socket, agent), 20, "READY=1 from the agent")

    assert ready[0].startswith("READY=1\nSTATUS=node n01: serving, HTTP port ")


def test_agent_pets_the_watchdog_and_says_stopping_on_sigterm(
    agent: subprocess.Popen[bytes], notify_socket: NotifySocket, tmp_path: Path
) -> None:
    wait_for(lambda: _ready(notify_socket, agent), 20, "READY=1 from the agent")
    wait_for(lambda: len(notify_socket.arrivals("WATCHDOG=1")) >= 3, 5, "three watchdog pets")

    agent.send_signal(signal.SIGTERM)

    assert agent.wait(15) == 0, (tmp_path / "agent.log").read_text()[-2000:]
    assert "STOPPING=1\nSTATUS=SIGTERM received: shutting down" in notify_socket.messages()


def test_a_supervisor_refusing_its_configuration_never_says_ready(
    tmp_path: Path, notify_socket: NotifySocket
) -> None:
    conf = tmp_path / "supervisor.toml"
    conf.write_text('[api]\ntoken = "short"\n')  # too short a token: exit 2 before serving

    proc = _start(
        [sys.executable, "-m", "supervisor", "--config", str(conf)],
        tmp_path / "bad.log",
        notify_socket,
    )

    assert proc.wait(15) == 2
    assert _ready(notify_socket) == []


# The supervisor's unit sets MemoryDenyWriteExecute=yes. Linux 6.3+ offers the same rule to any
# process (prctl PR_SET_MDWE, kept across exec): run the supervisor under it.
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
MDWE_WRAPPER = (
    "import ctypes, os, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    f"if libc.prctl({PR_SET_MDWE}, {PR_MDWE_REFUSE_EXEC_GAIN}, 0, 0, 0) != 0:\n"
    "    sys.exit(77)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)


def test_supervisor_serves_where_memory_may_not_be_writable_and_executable(
    tmp_path: Path, broker: Broker, notify_socket: NotifySocket
) -> None:
    (tmp_path / "token").write_text(TOKEN)
    conf = tmp_path / "supervisor.toml"
    conf.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[mqtt]\nport = {broker.port}\n'
        f'[api]\nport = {free_port()}\ntoken_file = "{tmp_path / "token"}"\n'
    )
    proc = _start(
        [sys.executable, "-c", MDWE_WRAPPER, "-m", "supervisor", "--config", str(conf)],
        tmp_path / "supervisor.log",
        notify_socket,
    )
    try:
        wait_for(
            lambda: proc.poll() is not None or _ready(notify_socket),
            20,
            "READY=1 from the supervisor under PR_SET_MDWE",
        )
        if proc.returncode == 77:
            pytest.skip("this kernel has no PR_SET_MDWE (Linux 6.3+)")
        assert proc.returncode is None, (tmp_path / "supervisor.log").read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        _stop(proc)
