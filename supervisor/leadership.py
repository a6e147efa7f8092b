"""Which of several supervisors on one PostgreSQL store leads, and for how long.

Two or more supervisors point at the same PostgreSQL (``store.url``); exactly one leads,
the others stand by. Leadership is:

* a **PostgreSQL advisory lock** (``pg_try_advisory_lock``, keyed on the store's schema,
  so that fleets sharing a database in schemas of their own do not share a leader) held
  by a session of its own, on a connection used for nothing else;
* a **term**, the ``leader`` table's counter, incremented by each new leader in the
  transaction that names it (with its API's URL, for the standbys to point clients at).
  Every command, start order, catalog and status the leader sends carries its term
  (``wire.Command.term``); agents keep the newest term seen and refuse an older one;
* a **lease**: the leadership session runs with ``idle_session_timeout = lease_s``, and
  the leader renews it (a query on that session) every ``poll_s`` from a thread of its
  own. A leader that stops (SIGSTOP, a frozen VM, a host cut off from PostgreSQL) has
  its session ended by the server ``lease_s`` after its last renewal, which frees the
  lock for a standby. The leader counts its own lease from when it *sent* its last
  renewal that was answered, and holds itself lost ``poll_s`` before the server could
  end it: by the time a standby can lead, the old leader has stopped acting, or, if it
  was paused through that moment, finds its lease over the instant it runs again, before
  it sends anything (:meth:`Leadership.leads` is a clock comparison, no round trip).

The store's writes are fenced too (:meth:`Leadership.fence`): each transaction of a
leading supervisor first reads the term ``FOR SHARE``, so that a write of a replaced
leader fails, and a new leader's term update waits for the writes of the old one that
began before it (the new leader loads the store only after its update).

A supervisor that loses the lead exits (``EXIT_LOST``, systemd starts it again as a
standby); it never goes on acting on what it holds in memory.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from supervisor.errors import StoreError
from supervisor.store_db import CONNECT_TIMEOUT_S, Db, open_pg, redacted

log = logging.getLogger(__name__)

EXIT_LOST = 3  # the exit status of a supervisor that lost the lead (phalanx-supervisor)
LEADER_HEADER = "X-Phalanx-Leader"  # a standby's answers name the leader's API URL in it
STANDBY_HEADER = "X-Phalanx-Standby"  # on every answer of a standby (phalanx.client)

_KEY = "hashtext('phalanx-leader:' || current_schema())"


@dataclass(frozen=True)
class Leader:
    term: int
    holder: str
    api_url: str
    since: float


class LeadershipLost(StoreError):
    """A store write of a supervisor whose term is over: another one leads."""


class Leadership:
    """This supervisor's part in the election on ``url`` (``holder``: its name in the
    ``leader`` table; ``api_url``: where clients reach it once it leads)."""

    def __init__(
        self,
        url: str,
        path: Path,
        *,
        api_url: str,
        lease_s: float,
        poll_s: float,
        holder: str | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if poll_s * 2 >= lease_s:
            raise ValueError(
                f"ha.poll_s ({poll_s}) must be under half of ha.lease_s ({lease_s}): a "
                "leader renews its lease every poll_s"
            )
        self.url = url
        self.path = path
        self.api_url = api_url
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.holder = holder or f"{socket.gethostname()}:{id(self):x}"
        self.term = 0  # ours, once we lead
        self.lost_reason = ""
        # The lease's clock: CLOCK_BOOTTIME counts a suspended host's sleep, as the
        # server's clock does (monotonic does not).
        self._clock = clock or _boottime
        self._conn: psycopg.Connection[Any] | None = None
        self._valid_until = 0.0  # our clock: the lease is ours until then
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._on_lost: Callable[[], None] | None = None
        self._lock = threading.Lock()  # the leadership connection, between the threads
        self._schema_ready = False
        # The leadership session failed and the lock is being taken again: we do not
        # lead meanwhile (a standby may already), but have not lost for sure.
        self._suspect = False
        self._suspect_until = 0.0
        self._defer_until = 0.0  # a standby tries for the lead again from then (try_lead)

    # --- standing by ----------------------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            if not self._schema_ready:  # the leader table is the store's (store_db)
                open_pg(self.url, self.path).close()
                self._schema_ready = True
            conn = psycopg.connect(
                self.url,
                autocommit=True,
                connect_timeout=CONNECT_TIMEOUT_S,
                **self.connection_options(),
            )
            for setting in self.session_settings():
                conn.execute(setting)
            conn.execute(f"SET idle_session_timeout = {int(self.lease_s * 1000)}")
            self._conn = conn
        return self._conn

    def connection_options(self) -> dict[str, Any]:
        """libpq's options for every connection of a supervisor in the election (its
        leadership session and its store's): a server or link gone silent fails a call
        within the lease, on TCP (a unix socket ignores them), instead of hanging it."""
        ms = int(self.lease_s * 1000)
        return {
            "keepalives": 1,
            "keepalives_idle": 1,
            "keepalives_interval": 1,
            "keepalives_count": max(2, int(self.lease_s) - 1),
            "tcp_user_timeout": ms,
        }

    def session_settings(self) -> list[str]:
        """What every such session sets first: a transaction left open by a leader that
        stopped (paused, its host gone) is ended by the server within the lease, so that
        the share lock it holds on the term (:meth:`fence`) does not hold up a new leader."""
        ms = int(self.lease_s * 1000)
        return [
            f"SET idle_in_transaction_session_timeout = {ms}",
            "SET tcp_keepalives_idle = 1",
            "SET tcp_keepalives_interval = 1",
            f"SET tcp_keepalives_count = {max(2, int(self.lease_s) - 1)}",
        ]

    def try_lead(self) -> int | None:
        """One attempt to take the lead: our new term, or None while another leads.
        A ``StoreError`` when PostgreSQL cannot be reached.

        After this standby lost its own connection (PostgreSQL restarted, the network
        blinked) it does not try for ``lease_s``: the leader lost its session too and is
        taking its lock again (``_relock``); a race for the lock would replace a leader
        that is alive and well. A leader that died leaves the standby's connection
        alone, and is replaced at the next poll."""
        if self._clock() < self._defer_until:
            return None
        try:
            with self._lock:
                conn = self._connect()
                sent = self._clock()
                if not _take_lock(conn):
                    return None
                with conn.transaction():
                    # Behind the share locks of the old leader's writes under way (ended by
                    # the server within the lease if it stopped): waited for, boundedly.
                    conn.execute(f"SET LOCAL lock_timeout = {int(self.lease_s * 2000)}")
                    # The term: one more than the last, and never below the epoch second,
                    # so that a store restored or made anew never goes back to a term the
                    # agents saw already (they would refuse every order).
                    row = conn.execute(
                        "INSERT INTO leader (id, term, holder, api_url, since) VALUES "
                        "(1, floor(extract(epoch FROM clock_timestamp()))::bigint, %s, %s, %s) "
                        "ON CONFLICT (id) DO UPDATE SET "
                        "term = GREATEST(leader.term + 1, excluded.term), "
                        "holder = excluded.holder, api_url = excluded.api_url, "
                        "since = excluded.since RETURNING term",
                        (self.holder, self.api_url, time.time()),
                    ).fetchone()
                assert row is not None
                self.term = int(row[0])
                self._valid_until = sent + self.lease_s - self.poll_s
                return self.term
        except psycopg.Error as exc:
            self._drop()
            self._defer_until = self._clock() + self.lease_s
            raise StoreError(
                self.path, f"cannot reach the supervisor store {redacted(self.url)}: {exc}"
            ) from exc

    def leader(self) -> Leader | None:
        """Who leads, as the ``leader`` table says (the newest term; it may have just
        lost its lease). None when none ever led or the store cannot be reached."""
        try:
            with self._lock:
                row = (
                    self._connect()
                    .execute("SELECT term, holder, api_url, since FROM leader WHERE id = 1")
                    .fetchone()
                )
        except psycopg.Error as exc:
            self._drop()
            self._defer_until = self._clock() + self.lease_s  # see try_lead
            log.warning("cannot read who leads: %s", exc)
            return None
        return Leader(int(row[0]), str(row[1]), str(row[2]), float(row[3])) if row else None

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # --- leading --------------------------------------------------------------------

    def leads(self) -> bool:
        """Whether we lead now: our lease has not run out on our own clock (a pause
        of this process ends it as surely as a lost connection). Once it has, the
        leadership is lost for good (``on_lost`` is called), whoever finds it out."""
        if self.term <= 0 or self.lost_reason:
            return False
        if self._clock() < self._valid_until:
            return True
        if not self._suspect:  # a suspect session is the renewal loop's to judge
            self._lose(
                f"the lease of term {self.term} ran out (no renewal answered for "
                f"{self.lease_s - self.poll_s:.1f}s)"
            )
        return False

    def keep(self, on_lost: Callable[[], None]) -> None:
        """Renew the lease every ``poll_s`` from a thread until it is lost or
        :meth:`close`; ``on_lost`` is called (from that thread) once, when it is."""
        self._on_lost = on_lost
        self._renewer = threading.Thread(target=self._renew_loop, name="leadership", daemon=True)
        self._renewer.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self._suspect and self._clock() >= self._suspect_until:
                self._lose(f"the leadership session of term {self.term} could not be renewed")
                return
            if not self._suspect and not self.leads():
                return  # lost (leads() said so)
            sent = self._clock()
            try:
                with self._lock:
                    conn = self._conn
                    if conn is None:
                        raise psycopg.OperationalError("the leadership connection is closed")
                    row = conn.execute("SELECT term FROM leader WHERE id = 1").fetchone()
            except psycopg.Error as exc:
                # The session ended (PostgreSQL restarted, the link broke): the lock went
                # with it. Take it again within the lease, if no one else did: our term
                # still in the table, read under the lock, means no one led meanwhile.
                if not self._suspect:
                    log.warning("the leadership session of term %d ended: %s", self.term, exc)
                    # From now on we do not lead: the lock went with the session and a
                    # standby may take it at once. Only the lock again, with our term
                    # still in the table, gives the lead back.
                    self._suspect = True
                    self._suspect_until = self._valid_until
                    self._valid_until = 0.0
                row = self._relock()
                if row is None:
                    continue  # not yet: again at the next poll, while the lease lasts
                sent = self._clock()
            if row is None or int(row[0]) != self.term:
                found = row[0] if row else None
                self._lose(f"term {found} leads now, not ours ({self.term})")
                return
            self._suspect = False
            self._valid_until = max(self._valid_until, sent + self.lease_s - self.poll_s)

    def _relock(self) -> tuple[Any, ...] | None:
        """A new leadership session holding the lock again: the ``leader`` row read
        under it, or None when PostgreSQL cannot be reached or the lock is held."""
        try:
            with self._lock:
                self._drop()
                conn = self._connect()
                if not _take_lock(conn):
                    # Held by another: this session, without the lock, must not serve
                    # the renewals (they would read our term back and lead without it).
                    self._drop()
                    return None
                row: tuple[Any, ...] | None = conn.execute(
                    "SELECT term FROM leader WHERE id = 1"
                ).fetchone()
        except (psycopg.Error, StoreError) as exc:
            log.warning("cannot take the lead of term %d again yet: %s", self.term, exc)
            with self._lock:
                self._drop()
            return None
        if row is not None and int(row[0]) == self.term:
            log.info("leadership of term %d taken again on a new session", self.term)
        return row

    def _lose(self, reason: str) -> None:
        if self.lost_reason or self._stop.is_set():
            return
        self.lost_reason = reason
        log.critical("this supervisor no longer leads: %s", reason)
        if self._on_lost is not None:
            self._on_lost()

    def fence(self, db: Db) -> None:
        """In a store transaction of ours: raise :class:`LeadershipLost` unless our term
        still leads (the row stays share-locked until the transaction ends)."""
        if not self.leads():  # found over here: lost (and said) for good
            raise LeadershipLost(
                self.path, f"not written: this supervisor does not lead (term {self.term})"
            )
        row = db.execute("SELECT term FROM leader WHERE id = 1 FOR SHARE").fetchone()
        if row is None or int(row[0]) != self.term:
            self._lose(f"term {row[0] if row else None} leads now, not ours ({self.term})")
            raise LeadershipLost(
                self.path,
                f"not written: term {row[0] if row else None} leads now, not ours ({self.term})",
            )

    def close(self) -> None:
        """Let go: the lock goes with the session (a clean stop hands over at once)."""
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=self.poll_s + 5)
        with self._lock:
            self._drop()


def _take_lock(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn``'s session now holds the leadership lock (it may already have)."""
    got = conn.execute(f"SELECT pg_try_advisory_lock({_KEY})").fetchone()
    return bool(got and got[0])


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def default_api_url(host: str, port: int, tls: bool) -> str:
    """``http(s)://HOST:PORT`` for the API, with this host's name for a wildcard bind."""
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}"
