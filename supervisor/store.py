"""The supervisor's persistent store: SQLite under the state directory, or PostgreSQL
(``store.url``; :mod:`supervisor.store_db` says how one set of queries serves both).

Only what must survive a restart is written: a node's identity, its drain and
last known health and state, the event log, the checkpoint catalog
(``supervisor.checkpoints.rows``), the jobs'
downsampled metric series (``supervisor.telemetry.rows``) and the API tokens, hashed
(``supervisor.auth.rows``). Heartbeats that change
nothing never touch the disk. Writes are small and synchronous (WAL mode), so
that a change acknowledged to an operator is on disk.

The writes that come by the thousand from the fleet (a node's events and record at a
birth or a heartbeat timeout, a 16,384-rank gang's exits) may be written *soon*
instead (:meth:`Store.add_event_soon`, :meth:`~Store.save_node_soon`,
:meth:`~Store.save_job_soon`) once the daemon has said how (:meth:`Store.defer`):
queued, a record's JSON built only when written (the newest one per node or job),
and written together, in one transaction, within ``defer``'s delay or before any
other write, so the event log keeps its order. Without ``defer`` they are written at
once.

The transactions that come by the hundred or every few seconds (a checkpoint's
landings, 512 a transaction, the rows retention retired, the metric series' flush)
commit on a worker thread (:meth:`Store.batch_async`): their fsyncs, some 160 a
checkpoint at 2,048 nodes, no longer hold the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from phalanx.jsonenc import dumps_text
from supervisor.errors import StoreCorrupt, StoreError
from supervisor.store_db import DB_ERRORS, Cursor, Db, open_pg, redacted
from supervisor.store_guard import GuardedConnection, is_corrupt, quick_check

log = logging.getLogger(__name__)

_SAVE_NODE = (
    "INSERT INTO nodes (id, record, updated_at) VALUES (?, ?, ?) "
    "ON CONFLICT(id) DO UPDATE SET record = excluded.record, updated_at = excluded.updated_at"
)
_SAVE_JOB = (
    "INSERT INTO jobs (id, state, record, updated_at) VALUES (?, ?, ?, ?) "
    "ON CONFLICT(id) DO UPDATE SET state = excluded.state, record = excluded.record, "
    "updated_at = excluded.updated_at"
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    id TEXT PRIMARY KEY,
    record TEXT NOT NULL,          -- JSON: identity from the last birth, drain, health
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    node TEXT,
    detail TEXT NOT NULL           -- JSON object
);
CREATE INDEX IF NOT EXISTS events_node ON events (node, id);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    record TEXT NOT NULL,          -- JSON: spec, generation, rank map, timings, exits
    updated_at REAL NOT NULL
);
"""


@dataclass(frozen=True)
class Event:
    id: int
    ts: float
    kind: str
    node: str | None
    detail: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "ts": self.ts,
            "kind": self.kind,
            "node": self.node,
            "detail": self.detail,
        }


class Store:
    """SQLite at ``path``, or PostgreSQL at ``url`` (``supervisor.store_db``; ``path`` then
    only names the store in its errors). ``backups``: the folder of the store's rolling
    backups (``supervisor.backup``), named in the message that refuses a damaged store.
    A store found damaged at open is refused (:class:`StoreCorrupt`); one met damaged
    later raises it from the read or write that met it, and ``corrupt`` keeps it
    (``supervisor.store_guard``)."""

    _db: Db

    def __init__(
        self,
        path: Path,
        *,
        backups: Path | None = None,
        url: str | None = None,
        pg_options: Mapping[str, Any] | None = None,
        pg_session: Sequence[str] = (),
    ) -> None:
        self.path = path
        self._wing_tables: set[str] = set()
        # A wing's rows object that must be one per store (``checkpoints.rows.CkptRows``:
        # its versions), by wing.
        self.wing_rows: dict[str, object] = {}
        self._rollback_hooks: list[Callable[[], None]] = []
        # Called at the end of a batch's block, before its COMMIT (a wing's writes held
        # for one statement of many, ``checkpoints.rows``), and whether a block runs.
        self._commit_hooks: list[Callable[[], None]] = []
        self._in_block = False
        # batch_async's COMMITs: their thread (made when first needed; its own, so that
        # no other work queued on the loop's executor holds a COMMIT, and the store's
        # gate, back), and the last one begun.
        self._committer: concurrent.futures.ThreadPoolExecutor | None = None
        self._committing: asyncio.Future[BaseException | None] | None = None
        # The writes queued by the *_soon methods, in order: (key, sql, args), where a key
        # (a node's or a job's record) holds the newest only; args is a thunk for those.
        self._soon: list[tuple[str | None, str, Callable[[], tuple[Any, ...]]]] = []
        self._soon_keys: dict[str, int] = {}
        self._schedule: Callable[[], None] | None = None
        self.backups = backups
        self.corrupt: StoreCorrupt | None = None
        self.url = url  # PostgreSQL's (None: SQLite at ``path``)
        # Called first in every write transaction (supervisor.leadership: a supervisor
        # that no longer leads writes nothing); None: no fence (SQLite, one supervisor).
        self.fence: Callable[[Db], None] | None = None
        self.where = redacted(url) if url is not None else str(path)  # in messages
        if url is not None:
            try:
                self._db = open_pg(url, path, options=pg_options, session=pg_session)
            except DB_ERRORS as exc:  # a StoreError (the server away) passes as it is
                raise StoreError(
                    path, f"cannot open the supervisor store {self.where}: {exc}"
                ) from exc
            return
        db: GuardedConnection | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(
                path, isolation_level=None, check_same_thread=False, factory=GuardedConnection
            )
            found = quick_check(db)  # before anything is loaded from it or written to it
            if found is not None:
                raise StoreCorrupt(path, found, backups)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(SCHEMA)
        except (OSError, sqlite3.Error, StoreError) as exc:
            if db is not None:
                db.close()
            if isinstance(exc, StoreError):
                raise
            if is_corrupt(exc):
                raise StoreCorrupt(path, str(exc), backups) from exc
            raise StoreError(path, f"cannot open the supervisor store {path}: {exc}") from exc
        db.on_corrupt = self._on_corrupt
        self._db = db

    def _on_corrupt(self, exc: sqlite3.DatabaseError) -> NoReturn:
        """A damaged page met at runtime: said once, loudly; the caller gets StoreCorrupt."""
        err = StoreCorrupt(self.path, str(exc), self.backups)
        if self.corrupt is None:
            log.critical(
                "%s. Until then the supervisor runs on what it holds in memory, and "
                "what it cannot read or write is lost",
                err,
            )
        self.corrupt = err
        raise err from exc

    def close(self) -> None:
        self._settle()
        if self._committer is not None:
            self._committer.shutdown()
            self._committer = None
        with contextlib.suppress(StoreError):
            self.flush()
        self._db.close()

    @property
    def db(self) -> Db:
        """The store's connection, for a wing's rows (``telemetry.rows``, ``auth.rows``):
        each wing creates its own tables and reads and writes them through it, with
        :meth:`write` and :meth:`batch` for the writes."""
        return self._db

    def open_tables(self, name: str, create: Callable[[sqlite3.Connection], None]) -> None:
        """Create (or migrate) a wing's SQLite tables with ``create``, once per open store:
        the wing owns its schema, the store its file and transactions. On PostgreSQL the
        schema of every wing is made at open (``supervisor.store_db``), so this does nothing."""
        if name in self._wing_tables or self.url is not None:
            return
        assert isinstance(self._db, sqlite3.Connection)
        try:
            create(self._db)
        except sqlite3.Error as exc:
            raise StoreError(
                self.path, f"cannot open the {name} tables of the store {self.path}: {exc}"
            ) from exc
        self._wing_tables.add(name)

    def write(self, sql: str, args: tuple[Any, ...]) -> Cursor:
        """One write; a failure is a :class:`StoreError` naming the store's file."""
        return self._write(sql, args)

    def write_many(self, sql: str, rows: Sequence[tuple[Any, ...]]) -> None:
        """One statement for each of ``rows`` (``executemany``: at 2,048 nodes a tier's
        16,384 landings cost a third less of the event loop than a write each); a failure
        is a :class:`StoreError`, or the error of a value no column takes (SQLite's
        ``OverflowError``, PostgreSQL's as a ``ValueError``), as :meth:`write`'s are."""
        self._written(lambda: self._db.executemany(sql, rows))

    @property
    def in_batch(self) -> bool:
        """Whether the block of a :meth:`batch` (or :meth:`batch_async`) runs now: what
        a wing writes will be committed with it, and its :meth:`before_commit` hooks
        run first."""
        return self._in_block

    def before_commit(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` at the end of every :meth:`batch`'s block, before its COMMIT,
        in its transaction: a wing that holds writes back to make them at once
        (``checkpoints.rows``) makes them there. Should it raise, the batch is rolled
        back and the error raised, as one of the block's own."""
        self._commit_hooks.append(hook)

    @contextlib.contextmanager
    def _block(self) -> Iterator[None]:
        """A batch's block: ``in_batch`` while it runs, and at its end, unless it raised,
        the ``before_commit`` hooks (in its transaction)."""
        self._in_block = True
        try:
            yield
            for hook in self._commit_hooks:
                hook()
        finally:
            self._in_block = False

    def on_rollback(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` whenever a :meth:`batch` is rolled back: a wing that keeps what
        it wrote in memory (``checkpoints.rows``) drops what the store no longer holds."""
        self._rollback_hooks.append(hook)

    def _rolled_back(self) -> None:
        for hook in self._rollback_hooks:
            hook()

    # --- writes soon ----------------------------------------------------------------

    def defer(self, schedule: Callable[[], None] | None) -> None:
        """Write the ``*_soon`` writes later: ``schedule()`` is called when the first
        one is queued and must see that :meth:`flush` runs soon (the daemon's event loop
        calls it after a short delay). None: write them at once."""
        self._schedule = schedule

    def _queue(self, key: str | None, sql: str, args: Callable[[], tuple[Any, ...]]) -> None:
        if self._schedule is None:
            self._write(sql, args())
            return
        if key is not None and key in self._soon_keys:
            self._soon[self._soon_keys[key]] = (key, sql, args)
            return
        if key is not None:
            self._soon_keys[key] = len(self._soon)
        self._soon.append((key, sql, args))
        if len(self._soon) == 1:
            self._schedule()

    @property
    def pending(self) -> int:
        """Writes queued by the ``*_soon`` methods, not yet written."""
        return len(self._soon)

    def flush(self) -> None:
        """Write what the ``*_soon`` methods queued, in one transaction. On an error
        they stay queued (and the error is raised)."""
        if not self._soon:
            return
        self._settle()
        queued = self._soon
        try:
            if self._db.in_transaction:  # within a batch: its transaction holds them
                for _key, sql, args in queued:
                    self._db.execute(sql, args())
            else:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    self._fenced()
                    for _key, sql, args in queued:
                        self._db.execute(sql, args())
                    self._db.execute("COMMIT")
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
        except DB_ERRORS as exc:
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.where}: {exc}"
            ) from exc
        self._soon, self._soon_keys = [], {}

    def add_event_soon(self, kind: str, node: str | None, detail: dict[str, Any]) -> None:
        """:meth:`add_event`, written soon (see :meth:`defer`)."""
        row = (time.time(), kind, node, dumps_text(detail))
        self._queue(
            None, "INSERT INTO events (ts, kind, node, detail) VALUES (?, ?, ?, ?)", lambda: row
        )

    def save_node_soon(self, node_id: str, record: Callable[[], dict[str, Any]]) -> None:
        """:meth:`save_node` of the newest ``record()``, written soon."""
        self._queue(
            f"node:{node_id}",
            _SAVE_NODE,
            lambda: (node_id, dumps_text(record()), time.time()),
        )

    def save_job_soon(
        self, job_id: str, state: Callable[[], str], record: Callable[[], dict[str, Any]]
    ) -> None:
        """:meth:`save_job` of the newest ``state()`` and ``record()``, written soon."""
        self._queue(
            f"job:{job_id}",
            _SAVE_JOB,
            lambda: (job_id, state(), dumps_text(record()), time.time()),
        )

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Run the writes of the block as one transaction: one fsync for all of them (the
        checkpoint catalog takes thousands of landings per step). Nested blocks join the
        outer one; an error rolls the whole block back."""
        self._settle()
        if self._db.in_transaction:
            yield
            return
        self._begin()
        try:
            self._fenced()
            with self._block():
                yield
        except BaseException:
            self._abort()
            raise
        try:
            self._db.execute("COMMIT")
        except DB_ERRORS as exc:
            self._abort()
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.where}: {exc}"
            ) from exc

    @contextlib.asynccontextmanager
    async def batch_async(self) -> AsyncIterator[None]:
        """:meth:`batch` for the event loop, its COMMIT on a thread of its own: the fsync (18-21
        ms on a busy host, past 0.1 s one time in a hundred, with SQLite's WAL checkpoint
        when one falls due) no longer holds the loop. At 2,048 nodes a checkpoint is some
        160 transactions of landings and retired rows: 3 s of the loop (issue 22).

        The block itself must not await: what runs on the loop meanwhile would write
        into its transaction. While the COMMIT runs, every statement of the store's
        (a read too) waits for it, and so does a :meth:`batch`; what the block changed in
        memory is seen by the loop before it is on disk (should the COMMIT fail, the
        rollback's hooks put it right before the store is used again). Cancelled while
        committing, the COMMIT still ends, and a failure is rolled back as ever."""
        while self._committing is not None and not self._committing.done():
            await asyncio.wait([self._committing])  # another's, without holding the loop
        self._settle()
        if self._db.in_transaction:  # within a batch: its transaction holds the block
            yield
            return
        self._begin()
        try:
            self._fenced()
            with self._block():
                yield
        except BaseException:
            self._abort()
            raise
        if self._committer is None:
            self._committer = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="store-commit"
            )
        gate = self._db.gate
        gate.acquire()  # free: settled above, and only the loop starts a commit
        try:
            done = asyncio.get_running_loop().run_in_executor(self._committer, self._commit_held)
        except BaseException:
            gate.release()
            self._abort()
            raise
        self._committing = done
        try:
            failed = await asyncio.shield(done)
        except asyncio.CancelledError:
            done.add_done_callback(lambda _: self._settle())
            raise
        self._settle()
        if isinstance(failed, StoreError):
            raise failed
        if failed is not None:
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.where}: {failed}"
            ) from failed

    def _commit_held(self) -> BaseException | None:
        """On the commit thread, holding the connection's gate: COMMIT, or ROLLBACK if it
        fails; the error. The rollback's hooks are left to the next statement on the
        loop (``Db.rolled_back``), or to :meth:`_settle`, whichever comes first."""
        try:
            self._db.execute_held("COMMIT")
            return None
        except BaseException as exc:
            with contextlib.suppress(*DB_ERRORS, StoreError):
                self._db.execute_held("ROLLBACK")
            self._db.rolled_back = self._rolled_back
            return exc
        finally:
            self._db.gate.release()

    def _settle(self) -> None:
        """Wait for a COMMIT on the commit thread (:meth:`batch_async`) to end; if it
        failed, run the rollback's hooks (once) before the store is used again."""
        gate = self._db.gate
        if gate.locked():
            with gate:
                pass
        hooks = self._db.rolled_back
        if hooks is not None:
            self._db.rolled_back = None
            hooks()

    def _begin(self) -> None:
        self.flush()  # what was queued before goes first, on its own
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except DB_ERRORS as exc:
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.where}: {exc}"
            ) from exc

    def _abort(self) -> None:
        with contextlib.suppress(*DB_ERRORS, StoreError):  # the error says what failed
            self._db.execute("ROLLBACK")
        self._rolled_back()

    def load_nodes(self) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT id, record FROM nodes").fetchall()
        return {node_id: json.loads(record) for node_id, record in rows}

    def save_node(self, node_id: str, record: dict[str, Any]) -> None:
        self._write(_SAVE_NODE, (node_id, dumps_text(record), time.time()))

    def load_jobs(self) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT id, record FROM jobs").fetchall()
        return {job_id: json.loads(record) for job_id, record in rows}

    def save_job(self, job_id: str, state: str, record: dict[str, Any]) -> None:
        self._write(_SAVE_JOB, (job_id, state, dumps_text(record), time.time()))

    def add_event(self, kind: str, node: str | None, detail: dict[str, Any]) -> Event:
        ts = time.time()
        cur = self._write(
            "INSERT INTO events (ts, kind, node, detail) VALUES (?, ?, ?, ?) RETURNING id",
            (ts, kind, node, dumps_text(detail)),
        )
        return Event(int(cur.fetchone()[0]), ts, kind, node, detail)

    def events(
        self, *, node: str | None = None, job: str | None = None, limit: int = 100, after: int = 0
    ) -> list[Event]:
        query = "SELECT id, ts, kind, node, detail FROM events WHERE id > ?"
        args: list[Any] = [after]
        if node is not None:
            query += " AND node = ?"
            args.append(node)
        if job is not None:
            query += " AND json_extract(detail, '$.job') = ?"
            args.append(job)
        query += " ORDER BY id DESC LIMIT ?"
        args.append(limit)
        rows = self._db.execute(query, args).fetchall()
        return [Event(r[0], r[1], r[2], r[3], json.loads(r[4])) for r in reversed(rows)]

    def first_events(self, kind: str) -> dict[str, float]:
        """Per node, the time of its first event of ``kind``."""
        rows = self._db.execute(
            "SELECT node, MIN(ts) FROM events WHERE kind = ? AND node IS NOT NULL GROUP BY node",
            (kind,),
        ).fetchall()
        return {str(r[0]): float(r[1]) for r in rows}

    def count_node_failures(self) -> int:
        """Nodes lost (offline but by a clean shutdown) or drained automatically."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM events WHERE (kind = 'state_changed' AND "
            "json_extract(detail, '$.state') = 'offline' AND "
            "json_extract(detail, '$.cause') != 'clean shutdown') OR "
            "(kind = 'node_drained' AND json_extract(detail, '$.by') = 'auto')"
        ).fetchone()
        return int(row[0])

    def _fenced(self) -> None:
        """In a write transaction: refuse it unless this supervisor still leads."""
        if self.fence is not None:
            self.fence(self._db)

    def _write(self, sql: str, args: tuple[Any, ...]) -> Cursor:
        cur: Cursor = self._written(lambda: self._db.execute(sql, args))
        return cur

    def _written(self, run: Callable[[], Any]) -> Any:
        """``run()`` (a statement on the connection), after what is queued soon; with a
        fence and no transaction open, in one with the fence. A failure is a
        :class:`StoreError` naming the store."""
        self._settle()
        self.flush()  # the writes queued soon go first: the event log keeps its order
        if self.fence is not None and not self._db.in_transaction:
            with self.batch():  # the fence and the write in one transaction
                return self._written(run)
        try:
            return run()
        except DB_ERRORS as exc:
            raise StoreError(
                self.path, f"cannot write the supervisor store {self.where}: {exc}"
            ) from exc
