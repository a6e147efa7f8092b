"""``Checkpointer()`` against a real agent-side service on a unix socket, in one process.

The agent's checkpoint service (``agentd.ckpt``) and its rank routes run on an
event loop in a thread; the supervisor's catalog (``supervisor.catalog``, on a
real SQLite store) commits what lands and feeds the catalog back, as MQTT would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ckpt_helpers import assert_bit_identical, training_state

from agentd.ckpt import CkptService
from agentd.ckpt_http import start_rank_socket
from ckpt import Checkpointer, TierError
from ckpt.remote import AgentError
from phalanx import wire
from supervisor.catalog import CheckpointCatalog
from supervisor.store import Store

JOB = "job-1"


class AgentHarness:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.loop = asyncio.new_event_loop()
        self.catalog = CheckpointCatalog(Store(root / "sup" / "state.db"))
        self.service: CkptService | None = None
        self.socket = root / "agent.sock"
        self.ready = threading.Event()
        self.tasks: set[asyncio.Future[None]] = set()
        self.stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),),
                                       daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    async def _main(self) -> None:
        self.stop = asyncio.Event()
        self.service = CkptService("n01", self.root / "data", self.root / "shm",
                                   (self.root / "objects").as_uri(), "", self._landing)
        self.service.configure(JOB, 1, wire.CkptPlan(tiers=["ram", "nvme", "object"],
                                                     keep={"ram": 1, "nvme": 2, "object": 2}))
        agent = SimpleNamespace(ckpt=self.service, node="n01")
        async with start_rank_socket(agent, self.socket):  # type: ignore[arg-type]
            self.ready.set()
            await self.stop.wait()
        await self.service.close()

    def _landing(self, msg: wire.CkptLanding) -> None:  # from the engine's threads
        def on_loop() -> None:
            assert self.service is not None
            if self.catalog.on_landing(msg, world_size=1):
                task = asyncio.ensure_future(
                    self.service.on_catalog(self.catalog.message(JOB, 1)))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

        self.loop.call_soon_threadsafe(on_loop)

    def env(self, generation: int = 1) -> dict[str, str]:
        return {"PHALANX_AGENT_SOCKET": str(self.socket), "PHALANX_JOB_ID": JOB,
                "PHALANX_GENERATION": str(generation), "RANK": "0", "WORLD_SIZE": "1"}

    def close(self) -> None:
        assert self.stop is not None
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentHarness]:
    (tmp_path / "shm").mkdir()
    harness = AgentHarness(tmp_path)
    for key, value in harness.env().items():
        monkeypatch.setenv(key, value)
    yield harness
    harness.close()


def committed_tiers(agent: AgentHarness, step: int) -> list[str]:
    view: dict[str, Any] = agent.catalog.view(JOB, 1, [])
    return sorted(next((s["committed"] for s in view["steps"] if s["step"] == step), {}))


def test_save_lands_in_agent_owned_ram_and_wait_returns_once_every_tier_committed(
    agent: AgentHarness,
) -> None:
    state = training_state()
    c = Checkpointer()

    assert c.save(3, state)
    c.wait(timeout=60)

    assert committed_tiers(agent, 3) == ["nvme", "object", "ram"]
    assert stat.S_IMODE(os.stat(agent.socket).st_mode) == 0o600
    assert (agent.root / "shm" / f"phalanx-{JOB}-r0.slot0").exists()  # the agent's segment
    assert (agent.root / "data" / "ckpt" / JOB / "000000000003" / "manifest.json").exists()
    c.close()
    step, restored = Checkpointer().restore()  # type: ignore[misc]
    assert step == 3
    assert_bit_identical(restored, state)


def test_restore_skips_a_corrupt_nvme_copy_for_the_object_store(agent: AgentHarness) -> None:
    state = training_state()
    c = Checkpointer()
    c.save(4, state)
    c.wait(timeout=60)
    for segment in (agent.root / "shm").iterdir():
        segment.unlink()
    shard = agent.root / "data" / "ckpt" / JOB / "000000000004" / "rank-00000.phx"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(data)

    reader = Checkpointer()
    found = reader.restore()

    assert found is not None and found[0] == 4
    assert reader.restored_from == "object"
    assert_bit_identical(found[1], state)


def test_a_rank_of_an_older_generation_cannot_save(
    agent: AgentHarness, monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert agent.service is not None
    agent.service.configure(JOB, 2, None)
    monkeypatch.setenv("PHALANX_GENERATION", "1")
    stale = Checkpointer()

    with pytest.raises(AgentError, match="generation 1 is older than generation 2"):
        stale.save(5, {"x": 1})
    with contextlib.suppress(Exception):
        stale.close()


def test_wait_names_the_tier_that_failed_while_the_others_commit(agent: AgentHarness) -> None:
    (agent.root / "objects").mkdir(exist_ok=True)
    (agent.root / "objects" / JOB).write_text("a file where the job's folder should be")
    c = Checkpointer()
    c.save(6, {"w": list(range(10))})

    with pytest.raises(TierError) as failed:
        c.wait(timeout=60)

    assert failed.value.tier == "object"
    deadline = time.monotonic() + 10
    while committed_tiers(agent, 6) != ["nvme", "ram"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert committed_tiers(agent, 6) == ["nvme", "ram"]
