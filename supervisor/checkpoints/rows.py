"""The checkpoint catalog's rows in the supervisor's store: their tables, reads and writes.

Four tables: ``ckpt_shards`` (every rank's shard landed at a tier: who landed it,
where the copy lies, its size and checksum, the generation that saved it),
``ckpt_commits`` (a step committed at a tier: every rank's shard there),
``ckpt_purges`` (a step retention dropped at a tier whose shard rows are still being
deleted, a slice at a time: :meth:`CkptRows.retire_step`) and
``ckpt_ended_catalogs`` (the nodes an ended job's catalog went out to, retained, and
when each let go of it). The store owns the file, the connection and the transactions
(:meth:`~supervisor.store.Store.write`, :meth:`~supervisor.store.Store.batch`); this
wing owns its schema and its queries, as ``telemetry.rows`` and ``auth.rows`` do.

:class:`CkptQueries` reads, on the store's connection; :class:`CkptRows` also writes,
and versions each (job, step, tier) at every write of its shards or commit, so that
what the catalog cached of a key is current while the version it read stands. There
is one :class:`CkptRows` per store (:meth:`CkptRows.of`): every write of these
tables goes through it, whoever makes it, so no version is missed.
"""

from __future__ import annotations

import collections
import itertools
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any, get_args

from phalanx.wire import CkptTierName
from supervisor.store import Store
from supervisor.store_db import Cursor, Db

# A shard as the catalog lists it: (node that landed it, holder, nbytes, checksum).
ShardRow = tuple[str, str | None, int, str]


class Unknown:
    """What a writer that does not know a value passes (:data:`UNKNOWN`)."""


UNKNOWN = Unknown()

CKPT_SCHEMA = """
CREATE TABLE IF NOT EXISTS ckpt_shards (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    tier TEXT NOT NULL,
    rank INTEGER NOT NULL,
    node TEXT NOT NULL,            -- the node that landed it
    holder TEXT,                   -- where the copy lies (the buddy, for the peer tier)
    nbytes INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    at REAL NOT NULL,
    generation INTEGER NOT NULL DEFAULT 0,  -- the job generation whose rank saved it
    PRIMARY KEY (job, step, tier, rank)
);
CREATE TABLE IF NOT EXISTS ckpt_commits (
    job TEXT NOT NULL,
    step INTEGER NOT NULL,
    tier TEXT NOT NULL,
    committed_at REAL NOT NULL,
    PRIMARY KEY (job, step, tier)
);
DROP INDEX IF EXISTS ckpt_shards_rank;  -- saved_in reads the primary key, each tier
DROP INDEX IF EXISTS ckpt_shards_node;  -- CkptRows counts each node's rows instead
CREATE TABLE IF NOT EXISTS ckpt_purges (
    job TEXT NOT NULL,             -- a step retention dropped at a tier: its shard rows
    step INTEGER NOT NULL,         -- are gone from every read and deleted a slice at a
    tier TEXT NOT NULL,            -- time (CkptRows.purge_some); the row goes with the
    PRIMARY KEY (job, step, tier)  -- last of them
);
CREATE TABLE IF NOT EXISTS ckpt_ended_catalogs (
    job TEXT NOT NULL,
    node TEXT NOT NULL,            -- a node the job's ended catalog was published for, retained
    released_at REAL,              -- when its agent let go of the job and the catalog was
    PRIMARY KEY (job, node)        -- cleared from the broker (NULL: not yet)
);
"""


# Leaves out the shard rows of a step retention dropped there, still being deleted (a
# query's ``ckpt_shards`` is ``s``).
NOT_RETIRED = (
    "AND NOT EXISTS (SELECT 1 FROM ckpt_purges p WHERE p.job = s.job AND p.step = s.step "
    "AND p.tier = s.tier) "
)
# Every tier, named: a read of one rank's rows of a step at any tier finds them by the
# primary key (job, step, tier, rank), a lookup per tier. An index on (job, step, rank)
# did before, and each landing and each deleted row wrote a page of it: 12-20 % of a
# 2,048-node checkpoint's SQLite time (issue 22).
ANY_TIER = "tier IN (" + ", ".join(f"'{t}'" for t in get_args(CkptTierName)) + ") "
PURGE_AT_ONCE = 2048  # shard rows of a retired step deleted in one transaction
# A rank's shard landed at a tier (landed again: its row replaced).
ADD_SHARD = (
    "INSERT INTO ckpt_shards (job, step, tier, rank, node, holder, nbytes, checksum, at, "
    "generation) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (job, step, tier, rank) DO UPDATE SET node = excluded.node, "
    "holder = excluded.holder, nbytes = excluded.nbytes, checksum = excluded.checksum, "
    "at = excluded.at, generation = excluded.generation"
)


def open_ckpt_tables(db: sqlite3.Connection) -> None:
    """Create the tables, or give a store's ``ckpt_shards`` from before landings named
    their generation that column."""
    db.executescript(CKPT_SCHEMA)
    columns = {r[1] for r in db.execute("PRAGMA table_info(ckpt_shards)")}
    if "generation" not in columns:
        db.execute("ALTER TABLE ckpt_shards ADD COLUMN generation INTEGER NOT NULL DEFAULT 0")


class CkptQueries:
    """The catalog's reads on ``db``, the store's connection."""

    def __init__(self, db: Db) -> None:
        self._db = db

    @property
    def db(self) -> Db:
        return self._db

    def commits(self, job: str) -> list[tuple[int, str, float]]:
        rows = self.db.execute(
            "SELECT step, tier, committed_at FROM ckpt_commits WHERE job = ? ORDER BY step", (job,)
        ).fetchall()
        return [(int(r[0]), str(r[1]), float(r[2])) for r in rows]

    def committed_tiers(self, job: str) -> dict[int, list[str]]:
        """Each step of ``job`` committed somewhere that still has a shard, and its tiers
        (what ``CheckpointCatalog.view`` says is committed, without reading every shard)."""
        rows = self.db.execute(
            "SELECT c.step, c.tier FROM ckpt_commits c WHERE c.job = ? AND EXISTS "
            "(SELECT 1 FROM ckpt_shards s WHERE s.job = c.job AND s.step = c.step) "
            "ORDER BY c.step, c.tier",
            (job,),
        ).fetchall()
        found: dict[int, list[str]] = {}
        for step, tier in rows:
            found.setdefault(int(step), []).append(str(tier))
        return found

    def shard_rows(
        self, job: str, keys: Iterable[tuple[int, str]]
    ) -> dict[tuple[int, str], dict[int, ShardRow]]:
        """Each (step, tier) of ``keys``: rank -> (node, holder, nbytes, checksum) of every
        shard landed there (one indexed read per key)."""
        found: dict[tuple[int, str], dict[int, ShardRow]] = {}
        for step, tier in keys:
            rows = self.db.execute(
                "SELECT rank, node, holder, nbytes, checksum FROM ckpt_shards "
                "WHERE job = ? AND step = ? AND tier = ?",
                (job, step, tier),
            ).fetchall()
            found[(step, tier)] = {int(r[0]): (str(r[1]), r[2], int(r[3]), str(r[4])) for r in rows}
        return found

    def ever_committed(self, job: str) -> bool:
        """Whether a step of ``job`` was ever committed at a tier (its event log says)."""
        row = self.db.execute(
            "SELECT 1 FROM events WHERE kind = 'ckpt_committed' AND "
            "json_extract(detail, '$.job') = ? LIMIT 1",
            (job,),
        ).fetchone()
        return row is not None

    def shard_nodes(self, job: str) -> set[str]:
        """The nodes that landed a shard of ``job`` that is still known."""
        return set(self.shard_rows_by_node(job))

    def shard_rows_by_node(self, job: str) -> collections.Counter[str]:
        """How many shard rows of ``job`` each node landed, read from every row of it."""
        rows = self.db.execute(
            "SELECT node, COUNT(*) FROM ckpt_shards s WHERE job = ? "
            + NOT_RETIRED
            + "GROUP BY node",
            (job,),
        ).fetchall()
        return collections.Counter({str(r[0]): int(r[1]) for r in rows})

    def shard_rows_of(self, job: str, step: int, tier: str) -> dict[int, tuple[int, ShardRow]]:
        """Every shard of ``step`` at ``tier``: rank -> (generation, (node, holder, nbytes,
        checksum)), as :meth:`shard_rows` reads them."""
        rows = self.db.execute(
            "SELECT rank, generation, node, holder, nbytes, checksum FROM ckpt_shards "
            "WHERE job = ? AND step = ? AND tier = ?",
            (job, step, tier),
        ).fetchall()
        return {int(r[0]): (int(r[1]), (str(r[2]), r[3], int(r[4]), str(r[5]))) for r in rows}

    def saved_in(self, job: str, step: int, rank: int, checksum: str) -> set[int]:
        """The generations whose saves of rank ``rank``'s shard of ``step`` have
        ``checksum``, at any tier."""
        rows = self.db.execute(
            "SELECT DISTINCT generation FROM ckpt_shards s WHERE job = ? AND step = ? AND "
            + ANY_TIER
            + "AND rank = ? AND checksum = ? "
            + NOT_RETIRED,
            (job, step, rank, checksum),
        ).fetchall()
        return {int(r[0]) for r in rows}

    def shards(self, job: str) -> list[tuple[int, str, int, str, str | None, int, str]]:
        """(step, tier, rank, node, holder, nbytes, checksum) of every landed shard."""
        rows = self.db.execute(
            "SELECT step, tier, rank, node, holder, nbytes, checksum FROM "
            "ckpt_shards s WHERE job = ? " + NOT_RETIRED + "ORDER BY step, tier, rank",
            (job,),
        ).fetchall()
        return [
            (int(r[0]), str(r[1]), int(r[2]), str(r[3]), r[4], int(r[5]), str(r[6])) for r in rows
        ]

    def ended_catalogs_sent_to(self, job: str) -> set[str]:
        """The nodes ``job``'s ended catalog was published for."""
        rows = self.db.execute(
            "SELECT node FROM ckpt_ended_catalogs WHERE job = ?", (job,)
        ).fetchall()
        return {str(r[0]) for r in rows}

    def ended_catalogs_let_go(self, job: str) -> set[str]:
        """The nodes that let go of the job, their ended catalogs cleared."""
        rows = self.db.execute(
            "SELECT node FROM ckpt_ended_catalogs WHERE job = ? AND released_at IS NOT NULL", (job,)
        ).fetchall()
        return {str(r[0]) for r in rows}

    def ended_catalogs_released(self, job: str) -> bool:
        """Whether the job's ended catalog went out and every node it went to let go."""
        row = self.db.execute(
            "SELECT COUNT(*), COUNT(released_at) FROM ckpt_ended_catalogs WHERE job = ?", (job,)
        ).fetchone()
        return bool(row[0]) and row[0] == row[1]


class CkptRows(CkptQueries):
    """The catalog's rows of ``store``: its reads on the store's connection, its writes
    through the store's transactions. Take it with :meth:`of` (one per store)."""

    def __init__(self, store: Store) -> None:
        store.open_tables("checkpoints", open_ckpt_tables)
        super().__init__(store.db)
        self.store = store
        # (job, step, tier) -> a number that changes at every write of its shards or
        # commit (a dropped key has none): what the catalog cached of it is current while
        # the number it was read at still stands.
        self.shard_versions: dict[tuple[str, int, str], int] = {}
        self._shard_clock = itertools.count(1)
        # job -> node -> the shard rows of the job that node landed, as the store holds
        # them: read once a job (shard_nodes), then kept by every write here, and read
        # again after a rollback. An index on (job, node) answered shard_nodes instead,
        # but each landing and each retention's delete wrote a page of it per node: at
        # 2,048 nodes a step's deletion at a tier held the event loop 0.22 s instead of
        # 0.08 s, and the landings took 31 % more of SQLite's time (issue 22).
        self._node_rows: dict[str, collections.Counter[str]] = {}
        store.on_rollback(self._node_rows.clear)
        # The steps retention dropped at a tier whose shard rows are still being deleted
        # (:meth:`retire_step`), oldest first: as the store's ``ckpt_purges`` holds them,
        # read when first needed and again after a rollback (None: to be read). A
        # restarted supervisor goes on deleting them.
        self._purges_read: dict[tuple[str, int, str], None] | None = None
        store.on_rollback(self._forget_purges)
        # Shard rows landed in the store's open batch, written at once by one statement
        # (:meth:`_write_held`) before any other of these tables' and at the batch's end:
        # a write each cost a third more of the event loop (issue 22).
        self._held: list[tuple[Any, ...]] = []
        store.on_rollback(self._drop_held)
        store.before_commit(self._write_held)

    @classmethod
    def of(cls, store: Store) -> CkptRows:
        """The store's catalog rows: made on first use, then the same for every caller
        (kept with the store, :attr:`~supervisor.store.Store.wing_rows`)."""
        rows = store.wing_rows.get("checkpoints")
        if not isinstance(rows, CkptRows):
            rows = cls(store)
            store.wing_rows["checkpoints"] = rows
        return rows

    @property
    def db(self) -> Db:
        if self._held:
            self._write_held()  # what is read sees every shard landed
        return self.store.db  # the store's (PostgreSQL's may be reconnected under it)

    def _write(self, sql: str, args: tuple[Any, ...]) -> Cursor:
        if self._held:
            self._write_held()  # in the order they were made
        return self.store.write(sql, args)

    def _drop_held(self) -> None:
        self._held = []  # rolled back with the batch they were landed in

    def _write_held(self) -> None:
        """Write the shard rows held (:meth:`add_shard`) in one statement."""
        if self._held:
            held, self._held = self._held, []
            self.store.write_many(ADD_SHARD, held)

    @property
    def _purges(self) -> dict[tuple[str, int, str], None]:
        if self._purges_read is None:
            rows = self.db.execute("SELECT job, step, tier FROM ckpt_purges").fetchall()
            self._purges_read = {(str(r[0]), int(r[1]), str(r[2])): None for r in rows}
        return self._purges_read

    def _forget_purges(self) -> None:
        self._purges_read = None

    # --- reads that leave out what retention dropped ----------------------------------

    def shard_rows(
        self, job: str, keys: Iterable[tuple[int, str]]
    ) -> dict[tuple[int, str], dict[int, ShardRow]]:
        keys = list(keys)
        found = super().shard_rows(job, [k for k in keys if (job, *k) not in self._purges])
        return {k: found.get(k, {}) for k in keys}

    def shard_rows_of(self, job: str, step: int, tier: str) -> dict[int, tuple[int, ShardRow]]:
        if (job, step, tier) in self._purges:
            return {}
        return super().shard_rows_of(job, step, tier)

    # --- writes ---------------------------------------------------------------------

    def add_shard(
        self,
        job: str,
        step: int,
        tier: str,
        rank: int,
        node: str,
        holder: str | None,
        nbytes: int,
        checksum: str,
        at: float,
        generation: int = 0,
        *,
        replaces: str | Unknown | None = UNKNOWN,
    ) -> None:
        """``replaces``: the node that landed the rank's row there now, which this one
        replaces (None: the rank has none there); the caller that does not know leaves it
        out, and the job's count of rows by node is read again when next needed.

        Within a batch (:meth:`~supervisor.store.Store.batch`) the row is held and written
        with the others held, by one statement, before any other statement here and at
        the batch's end (a failure then fails the batch, as the write would have)."""
        self._settle(job, step, tier)
        self._shards_changed(job, step, tier)
        row = (job, step, tier, rank, node, holder, nbytes, checksum, at, generation)
        if self.store.in_batch:
            self._held.append(row)  # written with the others at once, in the batch
        else:
            self._write(ADD_SHARD, row)
        counts = self._node_rows.get(job)
        if counts is None:
            return
        if isinstance(replaces, Unknown):
            del self._node_rows[job]
            return
        if replaces is not None:
            counts[replaces] -= 1
        counts[node] += 1

    def drop_step(self, job: str, step: int, tier: str) -> bool:
        """Forget a step at a tier, its rows deleted at once (a rollback, the SDC watch, a
        newer generation saving it again); True if anything was known."""
        self._settle(job, step, tier)
        self.shard_versions.pop((job, step, tier), None)
        gone = self._write(
            "DELETE FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ? RETURNING node",
            (job, step, tier),
        ).fetchall()
        self._write(
            "DELETE FROM ckpt_commits WHERE job = ? AND step = ? AND tier = ?", (job, step, tier)
        )
        self._rows_gone(job, gone)
        return bool(gone)

    def drop_shard(self, job: str, step: int, tier: str, rank: int) -> bool:
        """Forget one rank's copy of a step at a tier, and with it the step's commit there
        (a step is committed at a tier only while every rank's shard is); True if known."""
        self._settle(job, step, tier)
        self._shards_changed(job, step, tier)
        gone = self._write(
            "DELETE FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ? AND rank = ? "
            "RETURNING node",
            (job, step, tier, rank),
        ).fetchall()
        self._write(
            "DELETE FROM ckpt_commits WHERE job = ? AND step = ? AND tier = ?", (job, step, tier)
        )
        self._rows_gone(job, gone)
        return bool(gone)

    def retire_step(self, job: str, step: int, tier: str) -> bool:
        """Forget a step at a tier because retention removed it; True if anything was
        known. Its commit goes at once and its shard rows are gone from every read here,
        but they are deleted later, :data:`PURGE_AT_ONCE` a transaction
        (:meth:`purge_some`): at 2,048 nodes one statement deleting a step's 16,384 rows
        held the event loop 0.1-0.35 s on a busy host, four times a checkpoint (issue
        22). A write of the step at that tier first deletes what is left of them."""
        key = (job, step, tier)
        if key in self._purges:
            return False
        self.shard_versions.pop(key, None)
        by_node = self.db.execute(
            "SELECT node, COUNT(*) FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ? "
            "GROUP BY node",
            key,
        ).fetchall()
        self._write("DELETE FROM ckpt_commits WHERE job = ? AND step = ? AND tier = ?", key)
        if not by_node:
            return False
        self._write(
            "INSERT INTO ckpt_purges (job, step, tier) VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
            key,
        )
        self._purges[key] = None
        counts = self._node_rows.get(job)
        if counts is not None:
            counts.subtract({str(node): int(n) for node, n in by_node})
        return True

    @property
    def purging(self) -> int:
        """The retired steps (a step at a tier) whose shard rows are not all deleted yet."""
        return len(self._purges)

    def purge_some(self, limit: int | None = None) -> int:
        """Delete up to ``limit`` (:data:`PURGE_AT_ONCE`) shard rows of the oldest retired
        step, in the caller's transaction (:meth:`~supervisor.store.Store.batch`); how
        many were deleted."""
        if not self._purges:
            return 0
        limit = PURGE_AT_ONCE if limit is None else limit
        key = next(iter(self._purges))
        gone = self._write(
            "DELETE FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ? AND rank IN "
            "(SELECT rank FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ? "
            "ORDER BY rank LIMIT ?) RETURNING rank",
            (*key, *key, limit),
        ).fetchall()
        if len(gone) < limit:
            self._purged(key)
        return len(gone)

    def _settle(self, job: str, step: int, tier: str) -> None:
        """Before a write of a step at a tier: what is left of its rows, retired, goes."""
        key = (job, step, tier)
        if key in self._purges:
            self._write("DELETE FROM ckpt_shards WHERE job = ? AND step = ? AND tier = ?", key)
            self._purged(key)

    def _purged(self, key: tuple[str, int, str]) -> None:
        self._write("DELETE FROM ckpt_purges WHERE job = ? AND step = ? AND tier = ?", key)
        del self._purges[key]

    def _rows_gone(self, job: str, gone: Iterable[Sequence[Any]]) -> None:
        counts = self._node_rows.get(job)
        if counts is not None:
            counts.subtract(str(r[0]) for r in gone)

    def add_commit(self, job: str, step: int, tier: str, at: float) -> bool:
        self._settle(job, step, tier)
        self._shards_changed(job, step, tier)
        cur = self._write(
            "INSERT INTO ckpt_commits (job, step, tier, committed_at) "
            "VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
            (job, step, tier, at),
        )
        return cur.rowcount > 0

    def ended_catalogs_sent(self, job: str, nodes: list[str]) -> None:
        """The job's ended catalog goes out, retained, to ``nodes``."""
        with self.store.batch():
            for node in nodes:
                self._write(
                    "INSERT INTO ckpt_ended_catalogs (job, node) VALUES (?, ?) "
                    "ON CONFLICT DO NOTHING",
                    (job, node),
                )

    def ended_catalogs_cleared(self, job: str, nodes: list[str], at: float) -> None:
        """The job's ended catalogs of ``nodes`` were cleared from the broker."""
        with self.store.batch():
            for node in nodes:
                self._write(
                    "UPDATE ckpt_ended_catalogs SET released_at = ? WHERE job = ? AND "
                    "node = ? AND released_at IS NULL",
                    (at, job, node),
                )

    # --- versions -------------------------------------------------------------------

    def shard_version(self, job: str, step: int, tier: str) -> int:
        """The version of (job, step, tier)'s shards and commit now (see ``shard_versions``);
        one that has none (nothing was written of it since the store opened) gets one."""
        key = (job, step, tier)
        version = self.shard_versions.get(key)
        if version is None:
            version = self.shard_versions[key] = next(self._shard_clock)
        return version

    def forget_versions(self, job: str) -> None:
        """Drop the versions of ``job``'s keys (its catalog is no longer cached): a later
        read gets new ones. Its count of rows by node too."""
        for key in [k for k in self.shard_versions if k[0] == job]:
            del self.shard_versions[key]
        self._node_rows.pop(job, None)

    # --- nodes ----------------------------------------------------------------------

    def shard_nodes(self, job: str) -> set[str]:
        """The nodes that landed a shard of ``job`` that is still known: the rows counted
        by node once a job, then kept by every write here."""
        counts = self._node_rows.get(job)
        if counts is None:
            counts = self._node_rows[job] = self.shard_rows_by_node(job)
        return {node for node, rows in counts.items() if rows > 0}

    def _shards_changed(self, job: str, step: int, tier: str) -> None:
        """Before a write of (job, step, tier)'s shards or commit: what was read of it is
        stale (a write rolled back only makes a cache read it again)."""
        self.shard_versions[(job, step, tier)] = next(self._shard_clock)
