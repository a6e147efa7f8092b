"""``Checkpointer()`` against a real agent-side service on a unix socket, in one process.

The agent's checkpoint service (``agentd.ckpt``) and its rank routes run on an
event loop in a thread; the supervisor's catalog (``supervisor.checkpoints.catalog``, on a
real SQLite store) commits what lands and feeds the catalog back, as MQTT would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

from agentd.ckpt import CkptService, Standalone, start_rank_socket
from ckpt import (
    AgentError,
    Checkpointer,
    CheckpointError,
    LocalFolderStore,
    ObjectTier,
    TierError,
)
from ckpt.format import FormatError, decode, encode, seal, verify
from ckpt.tiers import step_dir
from phalanx import wire
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.store import Store
from tests.unit.ckpt.helpers import (
    assert_bit_identical,
    finish_reservations,
    small_tmpfs,
    training_state,
)
from tests.wait import wait_for

JOB = "job-1"


class AgentHarness:
    """One agent's checkpoint service and rank socket on a loop of their own, fed by a real
    catalog. ``deliver=False``: the catalog commits what lands, but this agent never hears
    of it (a restart before the catalog came, say); ``catalog``: the supervisor's catalog
    of an earlier agent on the same node."""

    def __init__(
        self,
        root: Path,
        *,
        deliver: bool = True,
        catalog: CheckpointCatalog | None = None,
        hold_steps: int | None = None,
    ) -> None:
        self.root = root
        self.deliver = deliver
        self.hold_steps = hold_steps  # the loss guard's reach, as the supervisor sends it
        self.ended = False  # the job ended: the catalogs delivered say so
        self.landings: list[wire.CkptLanding] = []  # every landing the agent published
        self.released: list[wire.CkptReleased] = []  # every job it let go of
        self.loop = asyncio.new_event_loop()
        self.catalog = catalog or CheckpointCatalog(Store(root / "sup" / "state.db"))
        self.service: CkptService | None = None
        self.socket = root / "agent.sock"
        self.ready = threading.Event()
        self.tasks: set[asyncio.Future[None]] = set()
        self.stop: asyncio.Event | None = None
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self._main(),), daemon=True
        )
        self.thread.start()
        assert self.ready.wait(10)

    async def _main(self) -> None:
        self.stop = asyncio.Event()
        self.service = CkptService(
            "n01",
            self.root / "data",
            self.root / "shm",
            (self.root / "objects").as_uri(),
            self._landing,
            # No catalog of a later generation comes here (start_generation): its ranks
            # restore from generation 1's after this wait, not the agent's default 20 s.
            catalog_wait_s=1.0,
        )
        self.service.configure(
            JOB,
            1,
            wire.CkptPlan(tiers=["ram", "nvme", "object"], keep={"ram": 1, "nvme": 2, "object": 2}),
        )
        async with start_rank_socket(Standalone("n01", self.service), self.socket):
            self.ready.set()
            await self.stop.wait()
        await self.service.close()

    def _landing(self, msg: wire.CkptLanding | wire.CkptReleased) -> None:  # from any thread
        if isinstance(msg, wire.CkptReleased):
            self.released.append(msg)
            return
        self.landings.append(msg)

        def on_loop() -> None:
            assert self.service is not None
            if self.catalog.on_landing(msg, world_size=1) and self.deliver:
                task = asyncio.ensure_future(
                    self.service.on_catalog(
                        self.catalog.messages(
                            JOB, 1, generation=1, ended=self.ended, hold_steps=self.hold_steps
                        )[0]
                    )
                )
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

        self.loop.call_soon_threadsafe(on_loop)

    def env(self, generation: int = 1) -> dict[str, str]:
        return {
            "PHALANX_AGENT_SOCKET": str(self.socket),
            "PHALANX_JOB_ID": JOB,
            "PHALANX_GENERATION": str(generation),
            "RANK": "0",
            "WORLD_SIZE": "1",
        }

    def close(self) -> None:
        assert self.stop is not None
        finish_reservations()
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        self.loop.close()


def start_agent(root: Path, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> AgentHarness:
    (root / "shm").mkdir(exist_ok=True)
    harness = AgentHarness(root, **kwargs)
    for key, value in harness.env().items():
        monkeypatch.setenv(key, value)
    return harness


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentHarness]:
    harness = start_agent(tmp_path, monkeypatch)
    yield harness
    harness.close()


@pytest.fixture
def small_nvme(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs where the agent's NVMe tier lives (``DATA_DIR/ckpt``), where
    mounting is permitted (root in a container)."""
    with small_tmpfs(tmp_path / "data" / "ckpt") as mnt:
        yield mnt


@pytest.fixture
def agent_on_small_nvme(
    small_nvme: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[AgentHarness]:
    harness = start_agent(small_nvme.parents[1], monkeypatch)
    yield harness
    harness.close()


def committed_tiers(agent: AgentHarness, step: int) -> list[str]:
    view: dict[str, Any] = agent.catalog.view(JOB, 1, [])
    return sorted(next((s["committed"] for s in view["steps"] if s["step"] == step), {}))


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    wait_for(check, timeout, what)


def nvme_shard(agent: AgentHarness, step: int) -> Path:
    return agent.root / "data" / "ckpt" / JOB / step_dir(step) / "rank-00000.phx"


def object_shard(agent: AgentHarness, step: int) -> Path:
    return agent.root / "objects" / JOB / step_dir(step) / "rank-00000.phx.zst"


def reset_manifest_writes(
    monkeypatch: pytest.MonkeyPatch, times: int, ending: str = "manifest.json"
) -> list[str]:
    """The fault: the object store resets the first ``times`` writes of a key ending so;
    the keys refused so far."""
    real = LocalFolderStore.put_stream
    refused: list[str] = []

    def resets(self: LocalFolderStore, key: str, parts: Any) -> None:
        if key.endswith(ending) and len(refused) < times:
            refused.append(key)
            raise ConnectionResetError("connection reset by the object store")
        real(self, key, parts)

    monkeypatch.setattr(LocalFolderStore, "put_stream", resets)
    return refused


def reported(agent: AgentHarness, event: str) -> list[wire.CkptLanding]:
    return [m for m in agent.landings if m.event == event]


class Exploit:
    """Unpickled, it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def padded(payload: bytes, nbytes: int) -> bytes:
    """A payload the size the catalog lists for the shard (a pickle ignores what follows
    its STOP opcode), so that no size check stands between it and the decoder."""
    assert len(payload) <= nbytes
    return payload + bytes(nbytes - len(payload))


def lying_shard(step: int, payload: bytes) -> bytes:
    """A well-formed, correctly sealed .phx whose header lies: a float32 tensor of 2**40
    elements (4 TiB) said to lie in the 64 data bytes, which hold a pickle."""
    header = json.dumps(
        {
            "data": 64,
            "meta": {"job": JOB, "step": step, "rank": 0},
            "tree": {
                "t": "dict",
                "k": ["w"],
                "v": [{"t": "tensor", "dtype": "float32", "shape": [1 << 40], "o": 0, "n": 64}],
            },
        }
    ).encode()
    data_start = -(-(32 + len(header)) // 64) * 64
    nbytes = data_start + 64 + 32
    shard = bytearray(nbytes)
    shard[:32] = struct.pack("<8sIIQQ", b"PHXSHARD", 1, len(header), nbytes, 0)
    shard[32 : 32 + len(header)] = header
    shard[data_start : data_start + 64] = padded(payload[:64], 64)
    seal(shard)
    return bytes(shard)


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


def test_a_lazy_save_through_the_agent_commits_the_state_of_its_call(
    agent: AgentHarness,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters())

    def step() -> None:
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()

    step()
    c = Checkpointer().attach(opt)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    before = bytes(encode(state))

    assert c.save(3, state)
    step()  # waits for the copy when it is still in flight, then changes every weight
    c.wait(timeout=60)

    assert committed_tiers(agent, 3) == ["nvme", "object", "ram"]
    c.close()
    found = Checkpointer().restore()
    assert found is not None and found[0] == 3 and bytes(encode(found[1])) == before


def test_an_ended_jobs_catalog_frees_its_ram_forgets_the_job_and_tells_the_supervisor(
    agent: AgentHarness,
) -> None:
    c = Checkpointer()
    c.save(3, training_state())
    c.wait(timeout=60)
    c.close()
    assert list((agent.root / "shm").glob(f"phalanx-{JOB}-r0.slot*"))
    assert agent.service is not None
    service = agent.service

    agent.deliver = False  # from now on the supervisor's catalogs all say "ended"
    ended = agent.catalog.messages(JOB, 1, generation=1, ended=True)[0]
    asyncio.run_coroutine_threadsafe(service.on_catalog(ended), agent.loop).result(30)
    wait_until(lambda: len(agent.released) == 1, "the agent to say it let go of the job")

    assert agent.released[0].job == JOB and agent.released[0].node == "n01"
    assert not list((agent.root / "shm").glob(f"phalanx-{JOB}-r*"))
    assert JOB not in service.jobs.catalogs and JOB not in service.jobs.plans
    assert JOB not in service.generations
    wait_until(lambda: JOB not in service.commits._appliers, "the applier to end and be dropped")
    assert nvme_shard(agent, 3).exists()  # the lower tiers keep what keep says

    # The broker hands the catalog again (a reconnect before the supervisor cleared it):
    # nothing is left to free, and the agent answers again, so the clear is sent again.
    asyncio.run_coroutine_threadsafe(service.on_catalog(ended), agent.loop).result(30)
    wait_until(lambda: len(agent.released) == 2, "a second answer")


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


def test_saving_one_step_twice_does_not_keep_both_ram_slots_from_the_next_save(
    agent: AgentHarness,
) -> None:
    c = Checkpointer(busy_timeout_s=10)  # the harness keeps 1 RAM step: 2 slots
    c.save(3, {"w": torch.full((1000,), 3.0)})  # the loop's save at step 3 ...
    c.wait(timeout=60)
    c.save(3, {"w": torch.full((1000,), 3.0)})  # ... and a final save of the same step
    c.wait(timeout=60)

    assert c.save(4, {"w": torch.full((1000,), 4.0)})  # timed out: both slots protected
    c.wait(timeout=60)
    c.close()


def test_a_save_the_write_down_cannot_take_leaves_no_ram_slot_busy(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = Checkpointer(busy_timeout_s=10)
    c.save(1, {"w": torch.full((1000,), 1.0)})
    c.wait(timeout=60)
    assert agent.service is not None
    store = agent.service.stores[(JOB, 0)]
    real = store.engine.submit

    def refuses(*args: Any) -> None:
        raise OSError("the write-down queue is gone")

    monkeypatch.setattr(store.engine, "submit", refuses)
    with pytest.raises(AgentError, match="write-down queue is gone"):
        c.save(2, {"w": torch.full((1000,), 2.0)})

    assert not [s.index for s in store.ram.slots if s is not None and s.busy]
    monkeypatch.setattr(store.engine, "submit", real)
    for step in (3, 4):  # both slots serve saves again
        assert c.save(step, {"w": torch.full((1000,), float(step))})
        c.wait(timeout=60)
    c.close()


def test_a_step_the_store_cannot_name_is_refused_with_400(agent: AgentHarness) -> None:
    from ckpt.remote import AgentClient, AgentEnv

    client = AgentClient(AgentEnv.from_environ())
    with pytest.raises(AgentError, match=r"step: .*less than or equal to 999999999999") as refused:
        client.call("POST", "/v1/ckpt/acquire", {"step": 10**12, "nbytes": 10})
    assert refused.value.status == 400


def test_the_last_save_of_an_ended_job_gets_its_manifests_before_its_ram_goes(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = Checkpointer()
    c.save(4, {"w": torch.full((1000,), 4.0)})
    c.wait(timeout=60)
    gate = threading.Event()
    real = LocalFolderStore.put_stream

    def slow(self: LocalFolderStore, key: str, parts: Any) -> None:  # a slow object store
        if f"/{step_dir(5)}/rank-" in key:
            assert gate.wait(30)
        real(self, key, parts)

    monkeypatch.setattr(LocalFolderStore, "put_stream", slow)
    c.save(5, {"w": torch.full((1000,), 5.0)})  # the last save: the rank exits, no wait
    c.close()
    wait_until(lambda: "nvme" in committed_tiers(agent, 5), "step 5 committed at nvme")

    agent.ended = True  # the job succeeded: every catalog from now on says so
    assert agent.service is not None
    ended = agent.catalog.messages(JOB, 1, generation=1, ended=True)[0]
    asyncio.run_coroutine_threadsafe(agent.service.on_catalog(ended), agent.loop).result(30)
    gate.set()  # the object store catches up while the agent finishes the write-down
    wait_until(lambda: bool(agent.released), "the agent to let go of the job")

    assert "object" in committed_tiers(agent, 5)
    assert (agent.root / "objects" / JOB / step_dir(5) / "manifest.json").exists()
    assert ObjectTier(LocalFolderStore(agent.root / "objects")).steps(JOB)[-1] == 5
    assert not list((agent.root / "shm").glob(f"phalanx-{JOB}-r*"))


def test_an_ended_jobs_manifest_that_failed_is_written_again_before_its_ram_goes(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = reset_manifest_writes(monkeypatch, 2, f"{step_dir(5)}/manifest.json")
    agent.ended = True  # the job ends with this save: every catalog from now on says so
    c = Checkpointer()
    c.save(5, {"w": torch.full((1000,), 5.0)})
    c.close()

    wait_until(lambda: bool(agent.released), "the agent to let go of the job")
    assert len(refused) == 2 and "object" in committed_tiers(agent, 5)
    assert ObjectTier(LocalFolderStore(agent.root / "objects")).steps(JOB) == [5]
    assert not list((agent.root / "shm").glob(f"phalanx-{JOB}-r*"))


def test_wait_for_a_later_step_is_not_failed_by_an_older_steps_manifest(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = reset_manifest_writes(monkeypatch, 10**6, f"{step_dir(3)}/manifest.json")
    c = Checkpointer()
    c.save(3, {"w": torch.full((1000,), 3.0)})
    with pytest.raises(TierError, match="connection reset") as failed:
        c.wait(timeout=60)  # step 3's manifest at the object store fails, again and again
    manifest = agent.root / "objects" / JOB / step_dir(3) / "manifest.json"
    assert manifest.as_uri() in str(failed.value)  # the object's URL, as written

    c.save(4, {"w": torch.full((1000,), 4.0)})
    c.wait(timeout=60)  # step 4 is committed everywhere: step 3's failure is not its own
    c.close()
    assert refused and (agent.root / "objects" / JOB / step_dir(4) / "manifest.json").exists()


def test_a_rank_of_an_older_generation_cannot_save(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
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
    wait_until(lambda: committed_tiers(agent, 6) == ["nvme", "ram"], "step 6 at nvme and ram", 10)


def test_a_manifest_the_object_store_refused_once_is_written_again_and_read_back(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reset_manifest_writes(monkeypatch, 1)
    state = {"w": torch.full((1000,), 3.0)}
    c = Checkpointer()
    c.save(3, state)

    with pytest.raises(TierError, match="connection reset") as failed:
        c.wait(timeout=60)
    assert failed.value.tier == "object" and "object" in committed_tiers(agent, 3)
    manifest = agent.root / "objects" / JOB / step_dir(3) / "manifest.json"
    wait_until(manifest.exists, "the manifest written again, with no new catalog")
    c.wait(timeout=60)  # committed everywhere now
    c.close()

    for segment in (agent.root / "shm").iterdir():  # the rank restarts elsewhere, say
        segment.unlink()
    nvme_shard(agent, 3).unlink()
    found = Checkpointer().restore()
    assert found is not None and found[0] == 3 and found[1]["w"].equal(state["w"])


def test_a_first_save_and_a_restore_have_the_slots_of_the_next_saves_ready_behind_them(
    agent: AgentHarness,
) -> None:
    state = {"w": torch.randn(1 << 18)}  # 1 MiB
    c = Checkpointer()
    c.save(1, state)  # it allocates one slot, and the other behind it
    assert agent.service is not None
    store = agent.service.stores[(JOB, 0)]
    wait_until(
        lambda: all(
            s is not None and s.capacity >= 1 << 20 and s.path.exists() for s in store.ram.slots
        ),
        "the slots allocated",
    )
    c.wait(timeout=60)
    c.close()

    fresh = Checkpointer()  # the rank restarted: it has mapped no slot yet
    found = fresh.restore()

    assert found is not None and fresh.restored_from == "ram"
    assert fresh.agent is not None
    wait_until(
        lambda: len(fresh.agent._maps) == len(store.ram.slots),  # type: ignore[union-attr]
        "the rank to map them ahead of its first save",
    )
    assert fresh.save(2, found[1])
    fresh.wait(timeout=60)
    fresh.close()


def start_generation(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
    generation: int,
) -> None:
    """The supervisor starts ``generation`` of the job here (its ranks get it)."""

    async def configure() -> None:
        assert agent.service is not None
        agent.service.configure(JOB, generation, agent.service.jobs.plans[JOB])

    asyncio.run_coroutine_threadsafe(configure(), agent.loop).result(10)
    monkeypatch.setenv("PHALANX_GENERATION", str(generation))


def rolled_back_to_10(agent: AgentHarness, monkeypatch: pytest.MonkeyPatch) -> Checkpointer:
    """Generation 1 committed steps 10 and 20; generation 2's rank restored step 10."""
    c = Checkpointer()
    for step in (10, 20):
        c.save(step, {"w": torch.full((1000,), float(step))})
        c.wait(timeout=60)
    c.close()
    start_generation(agent, monkeypatch, 2)
    c = Checkpointer()
    assert c.restore(10) is not None
    return c


def test_wait_in_a_generation_that_rolled_back_waits_for_its_own_commit(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = rolled_back_to_10(agent, monkeypatch)
    assert agent.service is not None
    agent.service.publish_threadsafe = lambda msg: None  # nothing it lands commits now
    c.save(20, {"w": torch.full((1000,), 20.5)})

    with pytest.raises(TimeoutError):  # generation 1's commit of step 20 is not this one
        c.wait(timeout=2)
    c.close()


def test_after_a_roll_back_the_ram_tier_keeps_the_newer_generations_saves(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = rolled_back_to_10(agent, monkeypatch)  # RAM still holds generation 1's step 20
    state = {"w": torch.full((1000,), 11.0)}
    c.save(11, state)
    c.wait(timeout=60)
    c.close()

    reader = Checkpointer()
    found = reader.restore(11)
    assert found is not None and reader.restored_from == "ram"  # not deleted for step 20's sake
    assert_bit_identical(found[1], state)


def test_a_step_saved_again_by_a_newer_generation_gets_its_own_manifest_and_reads_back(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = rolled_back_to_10(agent, monkeypatch)
    # Not generation 1's shard of step 20: other values, another size.
    new_state = {"w": torch.full((1000,), 20.5), "loader": {"index": 10**11}}
    c.save(20, new_state)
    c.wait(timeout=60)
    c.close()

    for segment in (agent.root / "shm").iterdir():  # the rank runs on another node now
        segment.unlink()
    nvme_shard(agent, 20).unlink()
    reader = Checkpointer()
    found = reader.restore(20)
    assert found is not None and reader.restored_from == "object"
    assert_bit_identical(found[1], new_state)


def test_a_roll_back_past_many_saves_lands_the_newer_generations_saves_as_its_own(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = Checkpointer()
    for step in range(1, 81):  # far more saves than the agent remembers the generation of
        c.save(step, {"w": torch.full((10,), float(step))})
    c.wait(timeout=60)
    c.close()
    start_generation(agent, monkeypatch, 2)
    c = Checkpointer()  # generation 2 starts over from step 3 (a restore or a fresh start)

    c.save(3, {"w": torch.full((10,), 3.5)})
    c.wait(timeout=60)  # generation 2's landings commit: none says generation 0 or 1
    c.close()
    assert {m.generation for m in agent.landings if m.step == 3 and m.event == "landed"} == {1, 2}


def test_a_commit_applied_while_a_newer_generation_saves_the_step_again_does_not_count(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entered, gate = threading.Event(), threading.Event()
    real = LocalFolderStore.put_stream

    def slow(self: LocalFolderStore, key: str, parts: Any) -> None:  # a slow object store
        if key.endswith(f"{step_dir(20)}/manifest.json") and not gate.is_set():
            entered.set()
            assert gate.wait(30)
        real(self, key, parts)

    monkeypatch.setattr(LocalFolderStore, "put_stream", slow)
    c = Checkpointer()
    c.save(20, {"w": torch.full((1000,), 20.0)})  # generation 1's save of step 20 ...
    assert entered.wait(30)  # ... committed: its manifest is being written (store.lock held)
    c.close()
    assert agent.service is not None
    agent.service.publish_threadsafe = lambda msg: None  # nothing it lands commits now
    start_generation(agent, monkeypatch, 2)
    c = Checkpointer()
    c.save(20, {"w": torch.full((1000,), 20.5)})  # generation 2 saves step 20 again

    gate.set()  # generation 1's manifest is written now, after the renewal
    store = agent.service.stores[(JOB, 0)]
    wait_until(
        lambda: (agent.root / "objects" / JOB / step_dir(20) / "manifest.json").exists(),
        "generation 1's manifest of step 20",
    )
    with store.lock:  # that _apply is over
        assert store.committed_upto.get("object", -1) < 20  # not generation 2's commit
    with pytest.raises(TimeoutError):
        c.wait(timeout=1)
    c.close()


# --- a full disk, a crafted shard -------------------------------------------------------------


def test_a_full_nvme_tier_fails_there_alone_and_keeps_its_last_committed_step(
    agent_on_small_nvme: AgentHarness,
    small_nvme: Path,
) -> None:
    agent = agent_on_small_nvme
    kept = {**training_state(), "w": torch.ones(256 << 10)}  # 1 MiB, on a 4 MiB filesystem
    c = Checkpointer()
    c.save(1, kept)
    c.wait(timeout=60)

    c.save(2, {"w": torch.ones(3 << 20)})  # 12 MiB: cannot fit

    with pytest.raises(TierError, match="disk is full") as failed:
        c.wait(timeout=60)
    assert failed.value.tier == "nvme" and str(small_nvme) in str(failed.value)
    assert [(m.step, m.tier) for m in reported(agent, "failed")] == [(2, "nvme")]
    error = reported(agent, "failed")[0].error
    assert str(nvme_shard(agent, 2)) in error and "disk is full" in error
    wait_until(
        lambda: committed_tiers(agent, 2) == ["object", "ram"],
        "step 2 committed at the other tiers",
    )
    assert not nvme_shard(agent, 2).exists() and not list(small_nvme.rglob("*.tmp-*"))
    assert (nvme_shard(agent, 1).parent / "manifest.json").is_file()
    # The catalog commits step 2 at RAM before the agent applies that commit, whose
    # retention then frees step 1's slot: until then a restore of step 1 reads RAM.
    wait_until(
        lambda: committed_tiers(agent, 1) == ["nvme", "object"],
        "step 1 kept at nvme and object, its RAM slot freed",
    )
    reader = Checkpointer()
    found = reader.restore(1)
    assert found is not None and found[0] == 1 and reader.restored_from == "nvme"
    assert_bit_identical(found[1], kept)
    c.save(3, {"w": torch.full((1000,), 3.0)})  # one that fits: the tier takes it again
    c.wait(timeout=60)
    assert committed_tiers(agent, 3) == ["nvme", "object", "ram"]
    c.close()


def test_a_pickle_planted_as_the_nvme_shard_never_runs_and_restore_uses_the_object_store(
    agent: AgentHarness,
) -> None:
    state = training_state()
    c = Checkpointer()
    c.save(5, state)
    c.wait(timeout=60)
    c.close()
    for segment in (agent.root / "shm").iterdir():
        segment.unlink()
    marker = agent.root / "pwned"
    shard = nvme_shard(agent, 5)
    shard.write_bytes(padded(pickle.dumps({"w": Exploit(marker)}), shard.stat().st_size))

    reader = Checkpointer()
    found = reader.restore()

    assert found is not None and found[0] == 5 and reader.restored_from == "object"
    assert_bit_identical(found[1], state)
    assert not marker.exists()
    corrupt = reported(agent, "corrupt")
    assert [(m.step, m.tier) for m in corrupt] == [(5, "nvme")]
    assert "refusing to read a pickle stream" in corrupt[0].error


def test_a_torch_save_file_in_the_object_store_and_a_lying_shard_on_nvme_are_both_refused(
    agent: AgentHarness,
) -> None:
    c = Checkpointer()
    c.save(6, {"w": torch.arange(100_000.0)})
    c.wait(timeout=60)
    c.close()
    for segment in (agent.root / "shm").iterdir():
        segment.unlink()
    marker = agent.root / "pwned"
    nbytes = nvme_shard(agent, 6).stat().st_size  # what the catalog lists
    zipped = agent.root / "exploit.pt"
    torch.save({"w": Exploit(marker)}, zipped)
    object_shard(agent, 6).write_bytes(
        zstandard.ZstdCompressor().compress(padded(zipped.read_bytes(), nbytes))
    )
    lie = lying_shard(6, pickle.dumps(Exploit(marker)))
    verify(lie)  # sealed as a real shard would be: only the checks make it safe
    with pytest.raises(FormatError, match="shape"):
        decode(lie)
    nvme_shard(agent, 6).write_bytes(lie)

    with pytest.raises(CheckpointError, match="no readable copy of step 6"):
        Checkpointer().restore()

    assert not marker.exists()
    corrupt = {m.tier: m.error for m in reported(agent, "corrupt")}
    assert sorted(corrupt) == ["nvme", "object"]
    assert "but xxh3_128:" in corrupt["nvme"] and "expected" in corrupt["nvme"]
    assert "refusing to read a zip archive" in corrupt["object"]


# --- an agent restart -------------------------------------------------------------------------


def test_steps_landed_before_an_agent_restart_get_their_manifest_and_retention_after_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    states = {step: {"w": torch.full((1000,), float(step))} for step in (1, 2, 3)}
    first = start_agent(tmp_path, monkeypatch, deliver=False)  # stops before the catalog comes
    try:
        c = Checkpointer()
        for step in (1, 2):
            c.save(step, states[step])
        wait_until(
            lambda: committed_tiers(first, 2) == ["nvme", "object", "ram"],
            "the catalog to commit step 2 everywhere",
        )
        c.close()
    finally:
        first.close()
    nvme = tmp_path / "data" / "ckpt" / JOB
    objects = tmp_path / "objects" / JOB
    assert not (nvme / step_dir(2) / "manifest.json").exists()
    second = start_agent(tmp_path, monkeypatch, catalog=first.catalog)  # same dirs, new agent
    try:
        c = Checkpointer()
        c.save(3, states[3])
        c.wait(timeout=60)  # the catalog now commits 3, and lists 1 and 2 as committed

        # keep is 2 at nvme and object: step 2 keeps its copies, with a manifest; 1 goes.
        for tier in (nvme, objects):
            assert sorted(p.name for p in tier.iterdir()) == [step_dir(2), step_dir(3)]
            assert (tier / step_dir(2) / "manifest.json").is_file()
        deleted = {(m.tier, m.step) for m in second.landings if m.event == "deleted"}
        assert {("nvme", 1), ("object", 1)} <= deleted
        for segment in (tmp_path / "shm").iterdir():
            segment.unlink()
        reader = Checkpointer()
        found = reader.restore(2)
        assert found is not None and reader.restored_from == "nvme"
        assert_bit_identical(found[1], states[2])
        c.close()
    finally:
        second.close()


def test_interval_auto_uses_the_job_mtbf_the_supervisor_sent_with_the_plan(
    agent: AgentHarness,
) -> None:
    async def configure() -> None:
        assert agent.service is not None
        agent.service.configure(
            JOB, 1, wire.CkptPlan(tiers=["ram", "nvme"], interval="auto", mtbf_s=7200.0)
        )

    asyncio.run_coroutine_threadsafe(configure(), agent.loop).result(10)

    with Checkpointer() as ckpt:
        assert (ckpt.policy.kind, ckpt.policy.mtbf_s) == ("auto", 7200.0)
        ckpt.policy.saved(0, 0.5)  # a 0.5 s stall: checkpoint every sqrt(2 x 0.5 x 7200) s
        assert ckpt.policy.seconds() == pytest.approx(84.85, abs=0.01)
    with Checkpointer(mtbf_s=800.0) as ckpt:  # the user's own figure wins
        assert ckpt.policy.mtbf_s == 800.0


def test_the_ranks_of_a_node_share_one_listing_of_a_remote_tier(
    agent: AgentHarness,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listed: list[str] = []
    real_keys = LocalFolderStore.keys

    def counted(self: LocalFolderStore, prefix: str) -> list[str]:
        listed.append(prefix)
        return real_keys(self, prefix)

    monkeypatch.setattr(LocalFolderStore, "keys", counted)
    (agent.root / "objects" / JOB / step_dir(3)).mkdir(parents=True)
    # What a restarted agent finds of its ranks there: rank 2 landed step 3.
    (agent.root / "objects" / JOB / step_dir(3) / "rank-00002.phx.zst").write_bytes(b"x")
    assert agent.service is not None

    stores = [agent.service.store(JOB, rank) for rank in range(4)]
    for store in stores:  # each seeding thread holds its store's lock until it is done
        with store.lock:
            pass

    assert listed == [f"{JOB}/"]
    assert [sorted(s.landed) for s in stores] == [[], [], [("object", 3)], []]


def test_retention_below_ram_keeps_the_steps_the_loss_guard_may_roll_back_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = start_agent(tmp_path, monkeypatch, hold_steps=4)  # keep: nvme 2, object 2
    try:
        with Checkpointer() as c:
            for step in range(1, 7):
                c.save(step, {"w": torch.full((100,), float(step))})
                c.wait(timeout=60)

        # keep alone would leave 5 and 6; the guard's reach of 4 steps holds 1 (at least 4
        # older than 6) and 3 (the newest of its 2-step span, next in line for the hold).
        for tier in (tmp_path / "data" / "ckpt" / JOB, tmp_path / "objects" / JOB):
            assert sorted(p.name for p in tier.iterdir()) == [step_dir(s) for s in (1, 3, 5, 6)]
    finally:
        agent.close()
