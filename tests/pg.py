"""A throw-away PostgreSQL cluster for tests: ``initdb`` in a temporary folder, ``pg_ctl``
on a unix socket there (no TCP port), trust auth, one database per store a test opens.

Debian's ``postgresql`` package provides the tools (``/usr/lib/postgresql/*/bin``;
``.ci/run`` installs it). ``initdb`` refuses to run as root: as root, the cluster runs
as the ``postgres`` user the package creates.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg


def pg_bin() -> Path:
    """The newest installed PostgreSQL's ``bin`` folder."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if not found:
        raise RuntimeError(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb): "
            "apt-get install postgresql (.ci/run does)"
        )
    return found[-1].parent


class PgCluster:
    def __init__(self) -> None:
        self.bin = pg_bin()
        self.root = Path(tempfile.mkdtemp(prefix="phx-pg-"))  # short: a socket path
        self.data = self.root / "data"
        self.port = 5432  # the socket's name only: nothing listens on TCP
        self._user: list[str] = []
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self._user = ["runuser", "-u", "postgres", "--"]
        self._names = itertools.count(1)

    def _run(self, *args: str) -> None:
        subprocess.run(
            [*self._user, *args], check=True, capture_output=True, text=True, timeout=120
        )

    def start(self) -> PgCluster:
        self._run(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        )
        self._ctl("start")
        return self

    def _ctl(self, action: str, *extra: str) -> None:
        # The server's log goes to a file: a server left holding our pipe would keep the
        # call waiting for its end.
        options = f"-k {self.root} -p {self.port} -c listen_addresses='' -c fsync=off"
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.root / "server.log"),
            "-w",
            "-t",
            "60",
            *extra,
            action,
        )

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@/{database}?host={self.root}&port={self.port}"

    def new_database(self) -> str:
        """The URL of a new, empty schema of its own (its search path: what a store sees
        is what a new database would show it; a schema is made in milliseconds, a
        database in a second)."""
        name = f"store{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as admin:
            admin.execute(f'CREATE SCHEMA "{name}"')
        return f"{self.url()}&options=-csearch_path%3D{name}"

    def restart(self) -> None:
        """Restart the server (``pg_ctl restart -m fast``): every connection is cut."""
        self._ctl("restart", "-m", "fast")

    def stop(self) -> None:
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
