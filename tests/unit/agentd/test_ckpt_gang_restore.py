"""A gang restores from one step, and a moved rank reads the peer copy where it lies.

Node n02 of a 2-node job died; a spare, n03, runs its rank 1 now. The step's
copies of rank 1 are on n02's disk (gone with it) and, as its peer copy, on
n01 (the buddy n02 pushed to). The supervisor's real catalog picks the step
the whole gang can read and names the holder; the spare's real agent service
reads the copy from n01's real peer routes over HTTP, although its own buddy
is another node. Ranks are ``Checkpointer()`` on the spare's rank socket.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agentd.access import Access
from agentd.ckpt import CkptService, Standalone, add_peer_routes, start_rank_socket
from ckpt import (
    Checkpointer,
    CheckpointError,
    LocalFolderStore,
    ObjectTier,
    ShardKey,
    TierManifest,
    encode,
    verify,
)
from phalanx import wire
from phalanx.agent_tokens import AgentKeys
from phalanx.local import free_port
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.store import Store
from tests.unit.ckpt.helpers import (
    COPY_PATHS,
    assert_bit_identical,
    finish_reservations,
    hold_every_ram_slot,
    training_state,
)

JOB = "job-1"
SECRET = "fleet-agent-secret-0123456789"  # each node gets its own token from it
KEYS = AgentKeys(SECRET)
STEP = 5


class Node:
    """One agent's checkpoint service, its rank socket and its peer routes on TCP."""

    def __init__(self, root: Path, name: str) -> None:
        self.root, self.name = root, name
        (root / "shm").mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.socket = root / "agent.sock"
        self.landings: list[wire.CkptLanding] = []
        self.loop = asyncio.new_event_loop()
        self.service: CkptService | None = None
        self.stop: asyncio.Event | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(
            target=self.loop.run_until_complete, args=(self._main(),), daemon=True
        )
        self.thread.start()
        assert self.ready.wait(10)

    async def _main(self) -> None:
        self.stop = asyncio.Event()
        self.service = CkptService(
            self.name,
            self.root / "data",
            self.root / "shm",
            (self.root / "objects").as_uri(),
            self.landings.append,
        )
        agent = Standalone(self.name, self.service)
        app = web.Application()
        add_peer_routes(app, agent, Access(self.name, KEYS.node_token(self.name)))
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        async with start_rank_socket(agent, self.socket):
            self.ready.set()
            await self.stop.wait()
        await runner.cleanup()
        await self.service.close()

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def peer(self) -> wire.PeerAddr:
        return wire.PeerAddr(node=self.name, address="127.0.0.1", http_port=self.port)

    def close(self) -> None:
        assert self.stop is not None
        finish_reservations()
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    n01, n03 = Node(tmp_path / "n01", "n01"), Node(tmp_path / "n03", "n03")
    catalog = CheckpointCatalog(Store(tmp_path / "sup" / "state.db"))
    state = training_state(seed=1)
    # Rank 1's step, as n02 left it on its buddy n01 before it died: a zstd peer copy and
    # the manifest part n02 wrote for its ranks.
    shard = encode(state)
    checksum = verify(shard)
    peer = ObjectTier(LocalFolderStore(tmp_path / "n01" / "data" / "ckpt-peer"), name="peer")
    peer.put(ShardKey(JOB, STEP, 1), memoryview(shard), checksum)
    peer.commit(TierManifest(JOB, STEP, {1: (checksum, len(shard))}, world_size=2))
    for rank, node, holder in ((0, "n01", "n02"), (1, "n02", "n01")):
        for tier in ("nvme", "peer"):
            catalog.on_landing(
                wire.CkptLanding(
                    node=node,
                    job=JOB,
                    step=STEP,
                    rank=rank,
                    tier=tier,
                    nbytes=len(shard),  # type: ignore[arg-type]
                    checksum=checksum,
                    holder=holder if tier == "peer" else None,
                    at=1.0,
                ),
                world_size=2,
            )
    # The spare's own buddy is another node (unreachable): the copy must come from n01.
    n03.call(
        _configure(
            n03,
            wire.CkptPlan(
                tiers=["ram", "nvme", "peer"],
                buddy=wire.PeerAddr(node="n04", address="127.0.0.1", http_port=free_port()),
            ),
        )
    )
    for key, value in {
        "PHALANX_AGENT_SOCKET": str(n03.socket),
        "PHALANX_JOB_ID": JOB,
        "PHALANX_GENERATION": "2",
        "RANK": "1",
        "WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(key, value)
    yield {
        "n01": n01,
        "n03": n03,
        "catalog": catalog,
        "state": state,
        "copy": tmp_path / "n01" / "data" / "ckpt-peer" / JOB / f"{STEP:012d}",
    }
    n03.close()
    n01.close()


async def _configure(node: Node, plan: wire.CkptPlan) -> None:
    assert node.service is not None
    node.service.configure(JOB, 2, plan)


def send_catalog(fleet: dict[str, Any], alive: set[str]) -> wire.CkptCatalog:
    """What the supervisor sends n03 when it launches generation 2 with rank 1 there."""
    n01, n03 = fleet["n01"], fleet["n03"]
    messages = fleet["catalog"].messages(
        JOB,
        2,
        generation=2,
        placement={0: "n01", 1: "n03"},
        peers={"n01": n01.peer()},
        alive=alive,
        credential=KEYS.peer_credential,  # n03's credential at n01, as the supervisor sends
    )
    mine = next(m for m in messages if m.node == "n03")
    assert n03.service is not None
    n03.call(n03.service.on_catalog(mine))
    return mine


@COPY_PATHS
def test_a_rank_moved_to_a_spare_restores_the_gang_step_from_the_buddy_holding_its_copy(
    fleet: dict[str, Any],
    path: str,
) -> None:
    sent = send_catalog(fleet, alive={"n01", "n03"})
    assert sent.restore_step == STEP
    if path == "streamed":
        hold_every_ram_slot()

    with Checkpointer() as ckpt:
        found = ckpt.restore()

    assert found is not None and found[0] == STEP and ckpt.restored_from == "peer"
    assert_bit_identical(found[1], fleet["state"])


def test_the_copy_a_spare_staged_is_in_the_catalog_and_a_second_restart_reads_it_from_ram(
    fleet: dict[str, Any],
) -> None:
    catalog, n03 = fleet["catalog"], fleet["n03"]
    for rank, node in ((0, "n01"), (1, "n02")):  # generation 1 saved the step in RAM too
        catalog.on_landing(
            wire.CkptLanding(
                node=node,
                job=JOB,
                step=STEP,
                rank=rank,
                tier="ram",
                nbytes=1,
                checksum=catalog.messages(JOB, 2)[0].steps[0].shards[0].checksum,
                generation=1,
                at=1.0,
            ),
            world_size=2,
        )
    send_catalog(fleet, alive={"n01", "n03"})
    with Checkpointer() as ckpt:
        assert ckpt.restore() is not None and ckpt.restored_from == "peer"  # staged in RAM

    staged = [m for m in n03.landings if m.tier == "ram" and m.event == "staged"]
    assert [(m.rank, m.step, m.generation) for m in staged] == [(1, STEP, 2)]
    assert catalog.on_landing(staged[0], world_size=2) is False  # still committed in RAM
    assert catalog.view(JOB, 2, ["ram"])["steps"][0]["where"]["ram"] == {"0": "n01", "1": "n03"}
    send_catalog(fleet, alive={"n01", "n03"})  # the gang restarts again before a new save
    with Checkpointer() as again:
        found = again.restore()
    assert found is not None and found[0] == STEP and again.restored_from == "ram"
    assert_bit_identical(found[1], fleet["state"])


def test_no_rank_restores_alone_when_the_gang_has_no_step_every_rank_can_read(
    fleet: dict[str, Any],
) -> None:
    sent = send_catalog(fleet, alive={"n03"})  # n01 died too: rank 0 has no copy left
    assert sent.restore_step is None

    with Checkpointer() as ckpt, pytest.raises(CheckpointError, match=r"can read no copy"):
        ckpt.restore()


def test_a_corrupt_peer_copy_is_reported_and_the_catalog_stops_offering_it(
    fleet: dict[str, Any],
) -> None:
    send_catalog(fleet, alive={"n01", "n03"})
    shard = fleet["copy"] / "rank-00001.phx.zst"
    shard.write_bytes(shard.read_bytes()[:-64] + bytes(64))

    with Checkpointer() as ckpt, pytest.raises(CheckpointError, match=r"no readable copy"):
        ckpt.restore()

    reports = [m for m in fleet["n03"].landings if m.event == "corrupt"]
    assert [(m.rank, m.step, m.tier) for m in reports] == [(1, STEP, "peer")]
    assert fleet["catalog"].on_landing(reports[0], world_size=2) is True
    view = fleet["catalog"].view(JOB, 2, ["nvme", "peer"])["steps"][0]
    assert sorted(view["committed"]) == ["nvme"]
    assert send_catalog(fleet, alive={"n01", "n03"}).restore_step is None


@COPY_PATHS
@pytest.mark.parametrize("keep", [0.5, 0.9])
def test_a_truncated_peer_copy_is_reported_once_staged_or_streamed(
    fleet: dict[str, Any],
    keep: float,
    path: str,
) -> None:
    # Staged, the agent finds it short and the rank reports it; streamed, the agent
    # reports it (the rank sees only a cut-off body and cannot tell).
    send_catalog(fleet, alive={"n01", "n03"})
    shard = fleet["copy"] / "rank-00001.phx.zst"
    body = shard.read_bytes()
    shard.write_bytes(body[: int(len(body) * keep)])  # the buddy serves all it has
    if path == "streamed":
        hold_every_ram_slot()

    with Checkpointer() as ckpt, pytest.raises(CheckpointError, match=r"no readable copy"):
        ckpt.restore()

    reports = [m for m in fleet["n03"].landings if m.event == "corrupt"]
    assert [(m.rank, m.step, m.tier) for m in reports] == [(1, STEP, "peer")]
    assert fleet["catalog"].on_landing(reports[0], world_size=2) is True
    assert send_catalog(fleet, alive={"n01", "n03"}).restore_step is None


def test_an_unreachable_holder_is_no_corrupt_copy_and_nothing_is_reported(
    fleet: dict[str, Any],
) -> None:
    # The buddy holding rank 1's copy does not answer where the catalog says it is.
    n03 = fleet["n03"]
    gone = wire.PeerAddr(node="n01", address="127.0.0.1", http_port=free_port())
    mine = next(
        m
        for m in fleet["catalog"].messages(
            JOB,
            2,
            generation=2,
            placement={0: "n01", 1: "n03"},
            peers={"n01": gone},
            alive={"n01", "n03"},
        )
        if m.node == "n03"
    )
    n03.call(n03.service.on_catalog(mine))

    with Checkpointer() as ckpt, pytest.raises(CheckpointError, match=r"no readable copy"):
        ckpt.restore()

    # A network error says nothing about the copy: the catalog keeps it.
    assert [m for m in n03.landings if m.event == "corrupt"] == []


def test_a_rank_whose_catalog_never_came_refuses_to_start_afresh(
    fleet: dict[str, Any],
) -> None:
    fleet["n03"].service.restores.catalog_wait_s = 0.5  # (ckpt.catalog_wait_s)
    # Generation 2 started on n03, but its catalog was lost on the way.
    with Checkpointer() as ckpt, pytest.raises(CheckpointError, match=r"no checkpoint catalog"):
        ckpt.restore()


def test_the_gang_step_is_listed_even_when_newer_steps_fill_the_message(
    fleet: dict[str, Any],
) -> None:
    catalog = fleet["catalog"]
    for step in range(10, 40):  # 30 newer steps, only in the RAM of n02, which died
        for rank in (0, 1):
            catalog.on_landing(
                wire.CkptLanding(
                    node="n02",
                    job=JOB,
                    step=step,
                    rank=rank,
                    tier="ram",
                    nbytes=1,
                    checksum="x",
                    at=1.0,
                ),
                world_size=2,
            )

    sent = send_catalog(fleet, alive={"n01", "n03"})

    assert sent.restore_step == STEP
    assert STEP in [s.step for s in sent.steps] and len(sent.steps) == wire.MAX_CATALOG_STEPS


RESHARD_STEP = 7


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (2, 3)])
def test_a_resharding_rank_reads_the_saved_ranks_shards_it_asks_for(
    fleet: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int, world: int
) -> None:
    """``elastic.reshard``: step 7 was saved by 2 ranks (in the object store); the gang
    now has ``world`` ranks on n03. A rank learns the saved size and reads any saved
    shard, also one that saved nothing of the step (a grown gang's rank 2)."""
    states = {r: training_state(seed=10 + r) for r in range(2)}
    objects = ObjectTier(LocalFolderStore(tmp_path / "n03" / "objects"), name="object")
    sums = {}
    for r, state in states.items():
        shard = encode(state)
        sums[r] = (verify(shard), len(shard))
        objects.put(ShardKey(JOB, RESHARD_STEP, r), memoryview(shard), sums[r][0])
        fleet["catalog"].on_landing(
            wire.CkptLanding(
                node="n01",
                job=JOB,
                step=RESHARD_STEP,
                rank=r,
                tier="object",
                nbytes=sums[r][1],  # type: ignore[arg-type]
                checksum=sums[r][0],
                at=2.0,
            ),
            world_size=2,
        )
    objects.commit(TierManifest(JOB, RESHARD_STEP, sums, world_size=2))
    messages = fleet["catalog"].messages(
        JOB, world, generation=2, placement=dict.fromkeys(range(world), "n03"), sharded=True
    )
    mine = next(m for m in messages if m.node == "n03")
    assert mine.restore_step == RESHARD_STEP
    n03 = fleet["n03"]
    n03.call(n03.service.on_catalog(mine))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))

    monkeypatch.setenv("PHALANX_RESHARD", "1")
    with Checkpointer() as ckpt:
        assert ckpt.saved_layout() == (RESHARD_STEP, 2)
        found = ckpt.restore_shards([1, 0], RESHARD_STEP)
        with pytest.raises(ValueError, match=r"saved rank\(s\) 2 of step 7"):
            ckpt.restore_shards([2])
        with pytest.raises(CheckpointError, match="restores step 7 now, not step 5"):
            ckpt.restore_shards([0], STEP)
        # The old call would read a part that is not this rank's: it says so.
        with pytest.raises(CheckpointError, match="saved by 2 ranks and this gang has"):
            ckpt.restore()

    assert found is not None and found[0] == RESHARD_STEP
    assert sorted(found[1]) == [0, 1] and ckpt.restored_from == "object"
    for r in range(2):
        assert_bit_identical(found[1][r], states[r], f"saved rank {r}")
