"""The store's guard against a damaged SQLite file.

A disk or filesystem fault, a copy taken mid-write, a file edited by hand: SQLite
notices a damaged page only when it reads it, as ``database disk image is malformed``
(``SQLITE_CORRUPT``) or ``file is not a database`` (``SQLITE_NOTADB``). Two guards:

* **At open**, :func:`quick_check` reads every page (``PRAGMA quick_check``: the
  b-trees and the free list, not the indexes' agreement with their tables), so a
  damaged store is refused before anything is loaded from it or written to it.
* **At runtime**, the store's connection is a :class:`GuardedConnection`: a statement
  or a fetch that meets a damaged page calls the store's ``on_corrupt``, which says so
  once, loudly, with how to recover, and raises
  :class:`~supervisor.errors.StoreCorrupt` (a ``StoreError``, which every caller of a
  write already handles) instead of a bare ``sqlite3.DatabaseError``.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeGuard

# The primary result codes of a damaged file (the extended codes share their low byte).
CORRUPT_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
# At most this many problems are listed by quick_check (the first is enough to refuse).
CHECK_MAX_ERRORS = 3


def is_corrupt(exc: BaseException) -> TypeGuard[sqlite3.DatabaseError]:
    """Whether ``exc`` is SQLite saying the file is damaged (not locked, not full)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return (
        isinstance(exc, sqlite3.DatabaseError)
        and code is not None
        and code & 0xFF in (CORRUPT_CODES)
    )


def quick_check(db: sqlite3.Connection) -> str | None:
    """None when ``PRAGMA quick_check`` finds the database sound; else what it found, on
    one line. A file too damaged to be checked raises ``sqlite3.DatabaseError``."""
    rows = [str(r[0]) for r in db.execute(f"PRAGMA quick_check({CHECK_MAX_ERRORS})").fetchall()]
    if rows == ["ok"]:
        return None
    lines = (line.strip() for r in rows for line in r.splitlines())
    return "; ".join(line for line in lines if line and not line.startswith("*** in database"))


class GuardedCursor(sqlite3.Cursor):
    """A cursor whose statements and fetches report a damaged file to its connection."""

    def execute(self, sql: str, parameters: Any = (), /) -> GuardedCursor:
        try:
            super().execute(sql, parameters)
        except sqlite3.DatabaseError as exc:
            self._met(exc)
        return self

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> GuardedCursor:
        try:
            super().executemany(sql, seq_of_parameters)
        except sqlite3.DatabaseError as exc:
            self._met(exc)
        return self

    def fetchone(self) -> Any:
        try:
            return super().fetchone()
        except sqlite3.DatabaseError as exc:
            self._met(exc)

    def fetchall(self) -> list[Any]:
        try:
            return super().fetchall()
        except sqlite3.DatabaseError as exc:
            self._met(exc)

    def fetchmany(self, size: int | None = 1) -> list[Any]:
        try:
            return super().fetchmany(size)
        except sqlite3.DatabaseError as exc:
            self._met(exc)

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except sqlite3.DatabaseError as exc:
            self._met(exc)

    def _met(self, exc: sqlite3.DatabaseError) -> NoReturn:
        handler = getattr(self.connection, "on_corrupt", None)
        if handler is not None and is_corrupt(exc):
            handler(exc)
        raise exc


class GuardedConnection(sqlite3.Connection):
    """``sqlite3.connect(..., factory=GuardedConnection)``: its ``execute`` runs on a
    :class:`GuardedCursor`, and a damaged page met calls ``on_corrupt`` (which raises)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_corrupt: Callable[[sqlite3.DatabaseError], NoReturn] | None = None
        # Held by a worker thread while it commits for the event loop, and what the next
        # statement runs first after that COMMIT failed (``supervisor.store_db.Db``).
        self.gate = threading.Lock()
        self.rolled_back: Callable[[], None] | None = None

    def execute(self, sql: str, parameters: Any = (), /) -> GuardedCursor:
        with self.gate:
            if self.rolled_back is not None:
                hooks, self.rolled_back = self.rolled_back, None
                hooks()
            return self.cursor(GuardedCursor).execute(sql, parameters)

    def executemany(self, sql: str, seq_of_parameters: Any, /) -> GuardedCursor:
        with self.gate:
            if self.rolled_back is not None:
                hooks, self.rolled_back = self.rolled_back, None
                hooks()
            return self.cursor(GuardedCursor).executemany(sql, seq_of_parameters)

    def execute_held(self, sql: str, /) -> GuardedCursor:
        """:meth:`execute`, by the thread that holds ``gate``."""
        return self.cursor(GuardedCursor).execute(sql)
