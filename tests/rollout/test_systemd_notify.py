"""phalanx.systemd: sd_notify over a real AF_UNIX datagram socket the test binds."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from phalanx.run import run_until_signal
from phalanx.systemd import Notifier
from tests.rollout.notify_socket import NotifySocket


def test_ready_sends_ready_and_status_in_one_datagram(notify_socket: NotifySocket) -> None:
    sent = Notifier(notify_socket.address).ready("serving on port 8740")

    notify_socket.wait_for("READY=1\nSTATUS=serving on port 8740")
    assert sent


def test_stopping_sends_stopping(notify_socket: NotifySocket) -> None:
    Notifier(notify_socket.address).stopping()

    notify_socket.wait_for("STOPPING=1")


def test_pet_sends_watchdog(notify_socket: NotifySocket) -> None:
    Notifier(notify_socket.address).pet()

    notify_socket.wait_for("WATCHDOG=1")


def test_a_status_with_newlines_stays_one_status_line(notify_socket: NotifySocket) -> None:
    Notifier(notify_socket.address).status("broker down\nREADY=1")

    notify_socket.wait_for("STATUS=broker down READY=1")


def test_an_abstract_socket_name_reaches_the_abstract_namespace() -> None:
    abstract = NotifySocket(f"@phalanx-test-{uuid.uuid4().hex}")
    try:
        Notifier(abstract.address).ready()

        abstract.wait_for("READY=1")
    finally:
        abstract.close()


def test_without_notify_socket_every_call_is_a_no_op() -> None:
    notifier = Notifier(None, watchdog_period_s=1.0)

    assert (notifier.ready("x"), notifier.stopping(), notifier.pet()) == (False, False, False)


def test_a_socket_nobody_listens_on_is_reported_not_raised(tmp_path: Path) -> None:
    assert Notifier(str(tmp_path / "gone.sock")).ready() is False


def test_the_environment_names_socket_and_watchdog_period(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))

    notifier = Notifier.from_environment(unset=False)

    assert (notifier.address, notifier.watchdog_period_s) == ("/run/systemd/notify", 30.0)


def test_reading_the_environment_unsets_it_so_children_do_not_inherit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))

    Notifier.from_environment()

    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(os.environ)


def test_a_watchdog_meant_for_another_process_is_not_petted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))

    assert Notifier.from_environment(unset=False).watchdog_period_s is None


def test_a_malformed_watchdog_period_disables_the_watchdog(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "soon")

    assert Notifier.from_environment(unset=False).watchdog_period_s is None


async def test_the_watchdog_is_petted_every_half_period(notify_socket: NotifySocket) -> None:
    notifier = Notifier(notify_socket.address, watchdog_period_s=0.2)

    task = asyncio.create_task(notifier.keep_watchdog())
    await asyncio.sleep(0.45)
    task.cancel()

    # Pets at 0, 0.1, 0.2, 0.3, 0.4 s; a loaded machine may lose one or two.
    assert len(notify_socket.arrivals("WATCHDOG=1")) >= 3


async def test_a_hung_event_loop_stops_petting_the_watchdog(notify_socket: NotifySocket) -> None:
    notifier = Notifier(notify_socket.address, watchdog_period_s=0.1)
    task = asyncio.create_task(notifier.keep_watchdog())
    await asyncio.sleep(0.12)

    hung_at = time.monotonic()
    time.sleep(0.5)  # noqa: ASYNC251 - the point: the event loop is stuck in a blocking call
    resumed_at = time.monotonic()
    await asyncio.sleep(0.12)
    task.cancel()

    pets = notify_socket.arrivals("WATCHDOG=1")
    assert not [t for t in pets if hung_at + 0.01 < t < resumed_at]
    assert [t for t in pets if t >= resumed_at], "petting resumes once the loop runs again"


async def test_a_watchdog_without_socket_returns_at_once() -> None:
    await asyncio.wait_for(Notifier(None, watchdog_period_s=0.1).keep_watchdog(), 1.0)


async def test_run_until_signal_says_stopping_on_sigterm(notify_socket: NotifySocket) -> None:
    notifier = Notifier(notify_socket.address)

    async def serve(stop: asyncio.Event) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 5.0)

    await run_until_signal(serve, notifier)

    notify_socket.wait_for("STOPPING=1\nSTATUS=SIGTERM received: shutting down")


async def test_run_until_signal_pets_the_watchdog_while_serving(
    notify_socket: NotifySocket,
) -> None:
    notifier = Notifier(notify_socket.address, watchdog_period_s=0.1)

    async def serve(stop: asyncio.Event) -> None:
        await asyncio.sleep(0.3)

    await run_until_signal(serve, notifier)

    assert len(notify_socket.arrivals("WATCHDOG=1")) >= 2
