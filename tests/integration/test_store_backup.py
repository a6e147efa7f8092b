"""A supervisor backs up its store while it runs; when its state.db is damaged, a
supervisor started on the newest backup, restored as docs/operations.md says, has the
fleet's state back.

The supervisors run in this process against a real Mosquitto, on real SQLite files.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from phalanx.jobspec import validate_spec
from phalanx.settings import MqttSettings
from supervisor.backup import backups_in
from supervisor.config import ApiSettings, StoreSettings, SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.errors import StoreCorrupt
from supervisor.jobs import JobState
from tests import wait
from tests.harness import TOKEN, Broker
from tests.unit.supervisor.fake_fleet import birth
from tests.unit.supervisor.test_store_corrupt import damage, fold, page_at

pytestmark = pytest.mark.integration

SPEC = {
    "name": "train",
    "team": "research",
    "command": ["python", "train.py"],
    "workdir": "/work",
    "nodes": 1,
    "ranks_per_node": 1,
}


async def until(check: Callable[[], object], what: str, timeout: float = 20.0) -> None:
    await wait.until(check, timeout, what, interval=0.05)


def backed_up(folder: Path, job: str) -> bool:
    """Whether the newest backup in ``folder`` holds ``job``."""
    found = backups_in(folder)
    if not found:
        return False
    db = sqlite3.connect(f"{found[-1].resolve().as_uri()}?mode=ro", uri=True)
    try:
        return db.execute("SELECT 1 FROM jobs WHERE id = ?", (job,)).fetchone() is not None
    finally:
        db.close()


async def test_supervisor_started_on_a_restored_backup_loads_the_fleet_state(
    tmp_path: Path, broker: Broker
) -> None:
    state = tmp_path / "supervisor"
    settings = SupervisorSettings(
        state_dir=state,
        mqtt=MqttSettings(port=broker.port, reconnect_max_s=1.0),
        api=ApiSettings(port=0),
        store=StoreSettings(backup_interval_s=0.3, backup_keep=3),
    )
    async with Supervisor(settings, TOKEN) as sup:
        sup.registry.on_birth(birth("n01"))
        sup.registry.drain("n01", "fan failing")  # held back: the job stays pending
        job = sup.jobs.submit(validate_spec(SPEC)).id
        await until(lambda: backed_up(state / "backup", job), "a backup holding the job")
        assert len(backups_in(state / "backup")) <= 3

    # The disk damages state.db: the supervisor refuses it and names the backups.
    fold(state / "state.db")
    damage(state / "state.db", page_at(state / "state.db"))
    with pytest.raises(StoreCorrupt, match=str(state / "backup")):
        Supervisor(settings, TOKEN)

    # Restored as docs/operations.md says: the damaged files aside, the newest backup in.
    aside = tmp_path / "damaged"
    aside.mkdir()
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        if (state / name).exists():
            (state / name).rename(aside / name)
    shutil.copy2(backups_in(state / "backup")[-1], state / "state.db")

    async with Supervisor(settings, TOKEN) as restored:
        node = restored.registry.nodes["n01"]
        assert node.drain is not None and node.drain.reason == "fan failing"
        assert node.birth is not None and node.birth.hostname == "n01.example"
        assert restored.jobs.jobs[job].state is JobState.PENDING
        assert [e.kind for e in restored.store.events(job=job)] == ["job_submitted"]
