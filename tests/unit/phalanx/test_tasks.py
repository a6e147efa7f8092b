"""One-off tasks have one owner: started, kept, logged when they fail, ended at shutdown."""

from __future__ import annotations

import asyncio
import logging

import pytest

from phalanx import tasks
from phalanx.tasks import Deadline, Tasks


async def test_a_task_that_fails_is_logged_with_its_name(caplog: pytest.LogCaptureFixture) -> None:
    owner = Tasks("agent n1")

    async def boom() -> None:
        raise ValueError("no such rank 7")

    task = owner.spawn(boom(), name="command-abc")
    assert task is not None
    await asyncio.wait([task])
    assert len(owner) == 0
    assert "agent n1: task command-abc failed: ValueError('no such rank 7')" in caplog.text


async def test_shutdown_waits_for_a_task_that_ends_within_the_limit() -> None:
    owner = Tasks("agent n1")

    async def short() -> str:
        await asyncio.sleep(0.05)
        return "acked"

    task = owner.spawn(short(), name="command")
    await owner.shutdown(timeout=5.0)
    assert task is not None and task.result() == "acked"


async def test_shutdown_cancels_what_outlives_the_limit_with_a_message_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner = Tasks("supervisor")
    seen: list[str] = []

    async def endless() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError as exc:
            seen.append(str(exc))
            raise

    task = owner.spawn(endless(), name="job-j1")
    await owner.shutdown(timeout=0.1)
    assert task is not None and task.cancelled()
    assert seen == ["supervisor shut down: job-j1 outlived 0.1 s"]
    assert "cancelling 1 task(s) still running after the 0.1 s shutdown limit: job-j1" in (
        caplog.text
    )


async def test_nothing_new_starts_once_shutdown_has_begun() -> None:
    owner = Tasks("agent n1")
    await owner.shutdown(timeout=0.1)
    ran: list[int] = []

    async def work() -> None:
        ran.append(1)

    assert owner.spawn(work(), name="command") is None  # closed, never awaited: no warning
    await asyncio.sleep(0)
    assert ran == [] and owner.closed


async def test_tasks_started_while_draining_are_waited_for_too() -> None:
    owner = Tasks("agent n1")
    done: list[str] = []

    async def second() -> None:
        await asyncio.sleep(0.05)
        done.append("second")

    async def first() -> None:
        await asyncio.sleep(0.05)
        done.append("first")

    owner.spawn(first(), name="first")
    shutdown = asyncio.create_task(owner.shutdown(timeout=5.0))
    await asyncio.sleep(0)
    # Closed: a task started now (e.g. by a message handled during the drain) is refused.
    assert owner.spawn(second(), name="second") is None
    await shutdown
    assert done == ["first"]


async def test_a_closed_owner_starts_nothing_while_its_running_tasks_go_on() -> None:
    owner = Tasks("supervisor")
    running = owner.spawn(asyncio.sleep(0.05, result="acked"), name="command")
    owner.close()

    late = asyncio.sleep(0)
    assert owner.spawn(late, name="late") is None
    assert running is not None and await running == "acked"
    await owner.shutdown(timeout=1.0)


async def test_a_task_that_ignores_cancellation_is_named_and_left(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tasks, "CANCEL_GRACE_S", 0.1)
    owner = Tasks("agent n1")
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    task = owner.spawn(stubborn(), name="stubborn")
    with caplog.at_level(logging.ERROR):
        await owner.shutdown(timeout=0.05)
    assert "1 task(s) ignored cancellation for 0.1 s and are left: stubborn" in caplog.text
    release.set()
    assert task is not None
    await task


def test_a_deadline_shares_what_is_left_between_steps() -> None:
    deadline = Deadline(10.0)
    assert 9.0 < deadline.left() <= 10.0
    assert not deadline.passed
    assert Deadline(0.0).left(floor=0.5) == 0.5
    assert Deadline(-1.0).passed
