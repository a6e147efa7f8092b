"""The store on PostgreSQL (``store.url``): the queries SQLite spells, translated; a
server restart ridden out; a server that cannot be reached refused with a StoreError.
The store's behaviour itself is tested on both databases by the tests that take
``open_store`` (test_registry, test_ckpt_catalog, test_series, ...)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from supervisor.auth.rows import TokenRows
from supervisor.config import StoreSettings
from supervisor.errors import StoreError
from supervisor.store import Store
from supervisor.store_db import redacted, to_pg
from tests.pg import PgCluster
from tests.unit.supervisor.conftest import OpenStore


def test_queries_are_translated_to_postgresqls_spelling() -> None:
    assert to_pg("BEGIN IMMEDIATE") == "BEGIN"
    assert (
        to_pg("SELECT 1 FROM events WHERE json_extract(detail, '$.job') = ? AND id > ?")
        == "SELECT 1 FROM events WHERE (detail::jsonb ->> 'job') = %s AND id > %s"
    )


def test_a_urls_password_never_shows_in_messages() -> None:
    assert redacted("postgresql://phx:s3cret@db.example:5433/phalanx") == (
        "postgresql://phx:***@db.example:5433/phalanx"
    )
    assert redacted("postgresql://phx@db.example/phalanx") == "postgresql://phx@db.example/phalanx"


def test_a_store_rides_out_a_restart_of_its_postgresql_server(
    tmp_path: Path, pg_cluster: PgCluster
) -> None:
    store = Store(tmp_path / "state.db", url=pg_cluster.new_database())
    try:
        store.save_node("n01", {"rack": "r1"})

        pg_cluster.restart()

        store.save_node("n02", {"rack": "r2"})  # on a new connection
        assert set(store.load_nodes()) == {"n01", "n02"}
    finally:
        store.close()


def test_a_server_that_cannot_be_reached_is_refused_naming_the_store(tmp_path: Path) -> None:
    url = f"postgresql://phx:s3cret@/phalanx?host={tmp_path}&port=5999"  # no server there

    with pytest.raises(StoreError, match="cannot open the supervisor store") as caught:
        Store(tmp_path / "state.db", url=url)

    assert "phx:***@" in str(caught.value)
    assert "s3cret" not in str(caught.value)


def test_a_store_url_other_than_postgresql_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match=r"url\n.*must be empty .* or a postgresql:// URL"):
        StoreSettings(url="mysql://db.example/phalanx")


def test_api_tokens_are_kept_and_revoked_alike_on_both_databases(open_store: OpenStore) -> None:
    store = open_store()
    seq = TokenRows(store).next_token_seq()
    TokenRows(store).add_token(
        seq, f"t{seq}", "ci", "member", "research", "ab" * 32, 10.0, "t0", None
    )
    TokenRows(store).add_token(
        seq + 1, f"t{seq + 1}", "ops", "operator", None, "cd" * 32, 11.0, "t0", 99.5
    )

    assert TokenRows(store).revoke_token(f"t{seq}", 12.0, "t0") is True
    assert TokenRows(store).revoke_token(f"t{seq}", 13.0, "t0") is False  # already
    assert TokenRows(store).next_token_seq() == seq + 2
    assert TokenRows(store).token_row(f"t{seq}") == (
        f"t{seq}",
        "ci",
        "member",
        "research",
        "ab" * 32,
        10.0,
        "t0",
        None,
        12.0,
        "t0",
    )
    assert [r[0] for r in TokenRows(store).token_rows()] == [f"t{seq}", f"t{seq + 1}"]
    assert TokenRows(store).token_row("t999") is None
