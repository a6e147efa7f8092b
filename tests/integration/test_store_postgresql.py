"""A supervisor on PostgreSQL (``store.url``) keeps the fleet's state there: a supervisor
started again on the same database has it back, and no SQLite file is made.

The supervisors run in this process against a real Mosquitto and the test session's
own PostgreSQL cluster (``tests.pg``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.jobspec import validate_spec
from phalanx.settings import MqttSettings
from supervisor.config import ApiSettings, StoreSettings, SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.jobs import JobState
from tests.harness import TOKEN, Broker
from tests.integration.test_store_backup import SPEC
from tests.pg import PgCluster
from tests.unit.supervisor.fake_fleet import birth

pytestmark = pytest.mark.integration


async def test_a_supervisor_on_postgresql_has_the_fleet_back_after_a_restart(
    tmp_path: Path, broker: Broker, pg_cluster: PgCluster
) -> None:
    state = tmp_path / "supervisor"
    settings = SupervisorSettings(
        state_dir=state,
        mqtt=MqttSettings(port=broker.port, reconnect_max_s=1.0),
        api=ApiSettings(port=0),
        store=StoreSettings(url=pg_cluster.new_database()),
    )
    async with Supervisor(settings, TOKEN) as sup:
        assert sup.backups is None  # PostgreSQL is backed up with its own tools
        sup.registry.on_birth(birth("n01"))
        sup.registry.drain("n01", "fan failing")  # held back: the job stays pending
        job = sup.jobs.submit(validate_spec(SPEC)).id

    async with Supervisor(settings, TOKEN) as again:
        node = again.registry.nodes["n01"]
        assert node.drain is not None and node.drain.reason == "fan failing"
        assert again.jobs.jobs[job].state is JobState.PENDING
        assert [e.kind for e in again.store.events(job=job)] == ["job_submitted"]
    assert not (state / "state.db").exists()
