"""The postgresql role (issue 26): converged into a staging tree for one database host and
three supervisor hosts, converged again (no change), and what it rendered applied to a
real throw-away cluster, on which its database tasks make the supervisors' role and
database; the supervisors' login then works over TLS with the password from the vault,
and nothing else does."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import yaml

from phalanx.certs import make_authority
from phalanx.local import free_port
from tests.pg import pg_bin
from tests.rollout.rollout_env import recap, run_playbook, tail

pytestmark = pytest.mark.rollout

PASSWORD = "st0re-pa'ss:w\\rd"  # a quote, a colon and a backslash
PLAYBOOK = """
- name: The supervisors' PostgreSQL
  hosts: postgresql
  gather_facts: false
  tasks:
    - name: Converge the role
      ansible.builtin.include_role:
        name: postgresql
        tasks_from: "{{ phalanx_test_tasks | default('main') }}"
"""


@dataclass
class PgTree:
    base: Path  # readable by the postgres user: the server reads its TLS files from it
    inventory: Path
    home: Path
    playbook: Path
    version: str
    port: int
    ca: Path
    first: subprocess.CompletedProcess[str]

    @property
    def conf_dir(self) -> Path:
        return self.base / f"db1/etc/postgresql/{self.version}/main"

    def converge(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_playbook(str(self.playbook), self.inventory, self.home, *args)


@pytest.fixture(scope="module")
def pg_tree() -> Iterator[PgTree]:
    base = Path(tempfile.mkdtemp(prefix="phx-pgrole-"))
    base.chmod(0o755)
    try:
        version = pg_bin().parent.name
        # What Debian's package leaves: the cluster's folder, whose version the role finds.
        (base / f"db1/etc/postgresql/{version}/main").mkdir(parents=True)
        authority = make_authority(base / "pki")
        server = authority.issue("server")  # for 127.0.0.1 and localhost
        port = free_port()
        inventory = {
            "all": {
                "vars": {
                    "ansible_connection": "local",
                    "ansible_python_interpreter": sys.executable,
                    "phalanx_supervisor_store_password": PASSWORD,
                    "phalanx_supervisor_store_url": f"postgresql://phalanx@127.0.0.1:{port}/phalanx",
                },
                "children": {
                    "postgresql": {
                        "hosts": {
                            "db1": {
                                "phalanx_root": str(base / "db1"),
                                "phalanx_postgresql_port": port,
                                "phalanx_postgresql_listen_addresses": ["127.0.0.1"],
                                "phalanx_postgresql_tls_cert_file": str(server.cert),
                                "phalanx_postgresql_tls_key_file": str(server.key),
                            }
                        }
                    },
                    "supervisors": {
                        "hosts": {
                            "sup-a": {"phalanx_postgresql_client_address": "127.0.0.1"},
                            "sup-b": {"ansible_host": "10.1.2.3"},
                            "sup-c": {"ansible_host": "fd00::7"},
                        }
                    },
                },
            }
        }
        (base / "hosts.yml").write_text(yaml.safe_dump(inventory))
        (base / "play.yml").write_text(PLAYBOOK)
        tree = PgTree(
            base,
            base / "hosts.yml",
            base / "home",
            base / "play.yml",
            version,
            port,
            authority.ca,
            subprocess.CompletedProcess([], 0),
        )
        tree.first = tree.converge()
        yield tree
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_role_converges_in_a_staging_tree(pg_tree: PgTree) -> None:
    assert pg_tree.first.returncode == 0, tail(pg_tree.first.stdout)
    assert recap(pg_tree.first.stdout)["db1"]["changed"] > 0


def test_a_second_converge_changes_nothing(pg_tree: PgTree) -> None:
    second = pg_tree.converge()

    assert second.returncode == 0, tail(second.stdout)
    assert recap(second.stdout)["db1"]["changed"] == 0, tail(second.stdout)


def test_pg_hba_lets_in_the_supervisor_hosts_only_over_tls_with_scram(pg_tree: PgTree) -> None:
    hba = (pg_tree.conf_dir / "pg_hba.conf").read_text()

    rules = [line.split() for line in hba.splitlines() if line and not line.startswith("#")]
    assert rules == [
        ["hostssl", "phalanx", "phalanx", address, "scram-sha-256"]
        for address in ("127.0.0.1/32", "::1/128", "10.1.2.3/32", "fd00::7/128")
    ]


def test_server_settings_listen_on_localhost_too_with_scram_and_tls(pg_tree: PgTree) -> None:
    conf = (pg_tree.conf_dir / "conf.d/phalanx.conf").read_text()

    assert "listen_addresses = 'localhost,127.0.0.1'\n" in conf
    assert f"port = {pg_tree.port}\n" in conf
    assert "password_encryption = 'scram-sha-256'\n" in conf
    assert f"ssl_key_file = '{pg_tree.conf_dir}/phalanx/server.key'\n" in conf
    key = pg_tree.conf_dir / "phalanx/server.key"
    assert key.stat().st_mode & 0o077 == 0o040  # 0640: PostgreSQL's rule for a key


def test_no_password_lands_in_the_staging_tree(pg_tree: PgTree) -> None:
    files = [p for p in (pg_tree.base / "db1").rglob("*") if p.is_file()]

    assert files
    assert [str(p) for p in files if PASSWORD.encode() in p.read_bytes()] == []


class Cluster:
    """initdb, with the role's pg_hba block (behind one trust line for the Unix socket the
    test administers it through) and its conf.d file included."""

    def __init__(self, tree: PgTree) -> None:
        self.bin = pg_bin()
        self.root = Path(tempfile.mkdtemp(prefix="phx-pgc-"))
        self.data = self.root / "data"
        self.as_owner: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root; the package's user runs the server
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            # As the role leaves them on a real host: root's, group postgres.
            for path in (tree.conf_dir / "phalanx", tree.conf_dir / "phalanx/server.key"):
                os.chown(path, 0, owner.pw_gid)
            self.as_owner = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync")
        hba = (tree.conf_dir / "pg_hba.conf").read_text()
        (self.data / "pg_hba.conf").write_text("local all all trust\n" + hba)
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(f"include '{tree.conf_dir}/conf.d/phalanx.conf'\nfsync = off\n")
        self._run(
            "pg_ctl", "-D", str(self.data), "-o", f"-k {self.root}", "-l",
            str(self.root / "server.log"), "-w", "-t", "60", "start",
        )  # fmt: skip

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run(
            [*self.as_owner, str(self.bin / tool), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        log = self.root / "server.log"
        assert done.returncode == 0, (
            f"{tool}: {done.stdout}{done.stderr}{log.read_text() if log.exists() else ''}"
        )

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(pg_tree: PgTree) -> Iterator[Cluster]:
    assert pg_tree.first.returncode == 0, tail(pg_tree.first.stdout)
    running = Cluster(pg_tree)
    yield running
    running.stop()


def _database_tasks(pg_tree: PgTree, cluster: Cluster) -> subprocess.CompletedProcess[str]:
    return pg_tree.converge(
        "-e",
        "phalanx_test_tasks=database.yml",
        "-e",
        f"phalanx_postgresql_psql={cluster.bin / 'psql'}",
        "-e",
        f"phalanx_postgresql_socket_dir={cluster.root}",
        "-e",
        f"_phalanx_postgresql_version={pg_tree.version}",
    )


def _connect(pg_tree: PgTree, **params: str) -> psycopg.Connection[tuple[object, ...]]:
    conninfo = {
        "host": "127.0.0.1",
        "port": str(pg_tree.port),
        "dbname": "phalanx",
        "user": "phalanx",
        "password": PASSWORD,
        "sslmode": "verify-full",
        "sslrootcert": str(pg_tree.ca),
        "connect_timeout": "10",
    } | params
    return psycopg.connect(**conninfo)  # type: ignore[arg-type]


def test_database_tasks_make_the_supervisors_login_once(pg_tree: PgTree, cluster: Cluster) -> None:
    first = _database_tasks(pg_tree, cluster)
    second = _database_tasks(pg_tree, cluster)

    assert first.returncode == 0, tail(first.stdout)
    assert recap(first.stdout)["db1"]["changed"] == 2, tail(first.stdout)  # made; password set
    assert second.returncode == 0, tail(second.stdout)
    assert recap(second.stdout)["db1"]["changed"] == 0, tail(second.stdout)
    with _connect(pg_tree) as conn:
        row = conn.execute("SELECT current_user, current_database(), pg_is_in_recovery()")
        assert row.fetchone() == ("phalanx", "phalanx", False)
        conn.execute("CREATE TABLE owned_here (x int)")  # the role owns its database


@pytest.mark.parametrize(
    ("what", "params"),
    [
        ("a wrong password", {"password": "not-it"}),
        ("a connection in clear", {"sslmode": "disable"}),
        ("another database", {"dbname": "postgres"}),
    ],
)
def test_the_server_refuses(
    pg_tree: PgTree, cluster: Cluster, what: str, params: dict[str, str]
) -> None:
    assert _database_tasks(pg_tree, cluster).returncode == 0
    with pytest.raises(psycopg.OperationalError), _connect(pg_tree, **params):
        pass
