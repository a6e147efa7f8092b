"""Leadership among supervisors on one PostgreSQL store (``supervisor.leadership``),
against the test session's own PostgreSQL cluster: the advisory lock, the term, the lease
on the leader's own clock, the fenced store writes and a server restart ridden out."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from pathlib import Path

import psycopg
import pytest

from supervisor.errors import StoreError
from supervisor.leadership import Leadership, LeadershipLost, default_api_url
from supervisor.store import Store
from tests.pg import PgCluster


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lead(
    url: str,
    name: str,
    *,
    clock: Clock | None = None,
    lease_s: float = 3.0,
    poll_s: float = 0.2,
) -> Leadership:
    return Leadership(
        url,
        Path("state.db"),
        api_url=f"http://{name}:8740",
        lease_s=lease_s,
        poll_s=poll_s,
        holder=name,
        clock=clock or time.monotonic,
    )


def test_one_leads_the_other_stands_by_and_leads_with_a_new_term_once_it_lets_go(
    pg_cluster: PgCluster,
) -> None:
    url = pg_cluster.new_database()
    a, b = lead(url, "a"), lead(url, "b")
    try:
        first = a.try_lead()
        # A term is never below the epoch second: a store made anew does not go back.
        assert first is not None and first >= int(time.time()) - 5 and a.leads()
        assert b.try_lead() is None and not b.leads()
        who = b.leader()
        assert who is not None
        assert (who.term, who.holder, who.api_url) == (first, "a", "http://a:8740")
        a.close()  # a clean stop lets go: its session ends (PostgreSQL ends the backend
        # a moment after the connection closes: under load, not at once)
        deadline = time.monotonic() + 10
        while (term := b.try_lead()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert term == first + 1 and b.leads()
        who = b.leader()
        assert who is not None and (who.term, who.holder) == (first + 1, "b")
    finally:
        a.close()
        b.close()


def test_a_store_of_another_schema_has_a_leader_of_its_own(pg_cluster: PgCluster) -> None:
    a, b = lead(pg_cluster.new_database(), "a"), lead(pg_cluster.new_database(), "b")
    try:
        assert a.try_lead() is not None and b.try_lead() is not None
    finally:
        a.close()
        b.close()


def test_the_lease_runs_out_on_the_leaders_own_clock_without_a_renewal() -> None:
    clock = Clock()
    a = lead("postgresql://unused", "a", clock=clock, lease_s=4.0)
    a.term, a._valid_until = 1, clock.now + 4.0 - 0.2  # as try_lead leaves them
    assert a.leads()
    clock.now += 3.7  # a pause (no renewal could run) short of lease_s - poll_s
    assert a.leads()
    clock.now += 0.2  # past it: the server may end the session any moment now
    assert not a.leads()


def test_a_poll_too_slow_for_the_lease_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"ha.poll_s \(2.0\).*ha.lease_s \(3.0\)"):
        Leadership("postgresql://x", Path("s"), api_url="", lease_s=3.0, poll_s=2.0)


def test_a_replaced_leaders_store_writes_are_refused_and_it_learns_it_lost(
    tmp_path: Path, pg_cluster: PgCluster
) -> None:
    url = pg_cluster.new_database()
    a, b = lead(url, "a"), lead(url, "b")
    store = Store(tmp_path / "state.db", url=url)
    lost = threading.Event()
    try:
        term = a.try_lead()
        assert term is not None
        store.fence = a.fence
        a._on_lost = lost.set
        store.add_event("while_leading", None, {})
        # A's session ends behind its back (as PostgreSQL ends a paused leader's), and B
        # takes over before A notices.
        assert a._conn is not None
        a._conn.close()
        assert b.try_lead() == term + 1
        with pytest.raises(LeadershipLost, match=f"term {term + 1} leads now"):
            store.add_event("after_losing", None, {})
        assert lost.is_set() and not a.leads()
        assert [e.kind for e in store.events()] == ["while_leading"]
    finally:
        store.fence = None
        store.close()
        a.close()
        b.close()


def test_a_leader_rides_out_a_restart_of_postgresql_and_keeps_its_term(
    pg_cluster: PgCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="supervisor.leadership")
    url = pg_cluster.new_database()
    a = lead(url, "a", lease_s=8.0, poll_s=1.0)  # it renews (and relocks) slowly ...
    lost = threading.Event()
    b = lead(url, "b")  # ... and the standby tries often
    try:
        term = a.try_lead()
        a.keep(lost.set)
        assert b.try_lead() is None and b.leader() is not None  # b stands by, connected
        pg_cluster.restart()
        # The standby, its own session lost too, does not race the leader for the lock.
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            with contextlib.suppress(StoreError):
                assert b.try_lead() is None
            b.leader()
            time.sleep(0.05)
        assert not lost.is_set() and a.leads() and a.term == term
        assert f"leadership of term {term} taken again on a new session" in caplog.text
        other = lead(url, "b")
        try:
            assert other.try_lead() is None  # the lock was taken again
        finally:
            other.close()
    finally:
        a.close()
        b.close()


def test_a_leader_whose_session_was_ended_stops_leading_at_its_next_renewal(
    pg_cluster: PgCluster,
) -> None:
    """Its session ended by the server (a backend killed): the lock is free at once, and
    a standby may lead within its poll; the old leader stops leading at its next
    renewal, well before its lease would have run out, and loses once it sees the lock
    taken for the rest of it."""
    url = pg_cluster.new_database()
    a, b = lead(url, "a", lease_s=3.0), lead(url, "b")
    lost = threading.Event()
    try:
        assert a.try_lead() is not None
        a.keep(lost.set)
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks "
                "WHERE locktype = 'advisory' AND granted"
            )
        assert b.try_lead() is not None  # the lock is free at once
        deadline = time.monotonic() + 1.0  # a few polls (0.2 s), less than the lease
        while a.leads() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not a.leads()
        assert lost.wait(8.0), "A should have lost once its lease ran out"
        assert "could not be renewed" in a.lost_reason
    finally:
        a.close()
        b.close()


def test_the_default_api_url_names_this_host_for_a_wildcard_bind() -> None:
    assert default_api_url("127.0.0.1", 8740, False) == "http://127.0.0.1:8740"
    assert default_api_url("::1", 8740, True) == "https://[::1]:8740"
    assert not default_api_url("0.0.0.0", 8740, False).startswith("http://0.0.0.0")
