"""Checkpoints under Phalanx, end to end: real agents, supervisor, broker and torch ranks.

The example job (examples/tinylm.py, a small model) checkpoints through
``ckpt.Checkpointer()``; each node's agent writes the shards down its tiers
(RAM, NVMe, the buddy node, the shared object folder) and the supervisor's
catalog commits them. Restarts use the real ``start_ranks`` command with a new
generation, sent on the broker as the supervisor would, on the same nodes. The
supervisor knows no in-place restart yet (that is the recovery controller), and
it stops ranks of a generation no live job owns: so the restart tests stop it
once the catalog has settled. Restores need only the agents (each holds the
job's retained catalog).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from phalanx import wire
from phalanx.agent_tokens import AgentKeys
from phalanx.local import free_port
from tests import tinylm as tiny
from tests.harness import Fleet, RawMqtt, rank_pid, wait_for
from tests.tinylm import REPO

pytestmark = pytest.mark.integration

TIERS = ["ram", "nvme", "peer", "object"]


def start_two_racks(fleet: Fleet, supervisor_extra: str = "", agent_extra: str = "") -> None:
    fleet.start_supervisor(extra=supervisor_extra)
    fleet.start_nodes(2, racks=2, extra=agent_extra)


def tinylm(*args: str) -> list[str]:
    return tiny.tinylm("--log-every", "1000", "--ckpt-digests", *args)


def catalog(fleet: Fleet, job: str) -> dict[str, Any]:
    out = fleet.cli("ckpt", "ls", job, "-o", "json")
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def committed(fleet: Fleet, job: str) -> dict[int, list[str]]:
    return {s["step"]: sorted(s["committed"]) for s in catalog(fleet, job)["steps"]}


def rank_lines(
    fleet: Fleet, node: str, job: str, generation: int, rank: int, key: str
) -> list[dict[str, Any]]:
    log = (
        fleet.root / "nodes" / node / "data" / "jobs" / job / f"g{generation}" / f"rank-{rank}.log"
    )
    found = []
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if line.startswith("{") and key in line:
            found.append(json.loads(line))
    return found


def retained_catalogs(fleet: Fleet, job: str) -> dict[str, bytes]:
    """The job's catalogs the broker keeps, as a client subscribing now is handed them."""
    raw = RawMqtt(fleet.broker.port)
    try:
        raw.subscribe(wire.catalog_filter(job))
        raw.sync()  # the retained ones came before it
        return {t: p for t, p in raw.heard() if p and t.startswith(wire.catalog_prefix(job))}
    finally:
        raw.close()


def test_checkpoints_land_in_all_four_tiers_are_kept_per_tier_and_ckpt_ls_shows_them(
    fleet: Fleet,
) -> None:
    start_two_racks(fleet)
    job = fleet.submit(
        name="ckpt",
        nodes=2,
        ranks_per_node=2,
        workdir=str(REPO),
        command=tinylm("--steps", "12", "--ckpt-every", "4"),
        checkpoint={"tiers": TIERS, "keep": {"ram": 2, "nvme": 1, "peer": 1, "object": 2}},
        guard="off",  # `keep` alone: the loss guard holds steps of its own (test_rollback.py)
    )
    fleet.wait_job(job["id"], "succeeded", timeout=120)

    # Every step was committed at every tier (the catalog's event log says when) ...
    events = fleet.client().get(f"/v1/events?job={job['id']}&limit=1000")
    commits = sorted(
        (e["detail"]["step"], e["detail"]["tier"]) for e in events if e["kind"] == "ckpt_committed"
    )
    assert commits == sorted((s, t) for s in (4, 8, 12) for t in TIERS)
    # ... and is kept per tier: the newest everywhere but in RAM, which the agents free
    # once the job has ended; the one before only where 2 are kept; none older.
    wanted = {12: ["nvme", "object", "peer"], 8: ["object"]}
    wait_for(lambda: committed(fleet, job["id"]) == wanted, 30, f"the catalog to hold {wanted}")
    refs = fleet.job(job["id"])["summary"]["checkpoints"]  # the job's own view lists them
    assert [(c["step"], c["tiers"]) for c in refs] == [(8, ["object"]), (12, sorted(wanted[12]))]
    table = fleet.cli("ckpt", "ls", job["id"]).stdout.splitlines()
    assert table[0].split() == ["STEP", "COMMITTED", "PARTIAL", "SIZE", "LOSS"]
    assert table[1].split()[:3] == ["12", "nvme,peer,object", "-"]
    assert table[2].split()[:3] == ["8", "object", "-"]
    data = fleet.root / "nodes"
    for node, buddy, ranks in (("n01", "n02", (0, 1)), ("n02", "n01", (2, 3))):
        for rank in ranks:
            name = f"rank-{rank:05d}.phx"
            steps = {
                "nvme": data / node / "data" / "ckpt" / job["id"],
                "peer": data / buddy / "data" / "ckpt-peer" / job["id"],
                "object": fleet.root / "objects" / job["id"],
            }
            assert sorted(p.name for p in steps["nvme"].iterdir()) == ["000000000012"]
            assert sorted(p.name for p in steps["peer"].iterdir()) == ["000000000012"]
            assert sorted(p.name for p in steps["object"].iterdir()) == [
                "000000000008",
                "000000000012",
            ]
            assert (steps["nvme"] / "000000000012" / name).is_file()
            assert (steps["peer"] / "000000000012" / f"{name}.zst").is_file()
            assert (steps["object"] / "000000000012" / f"{name}.zst").is_file()
    assert list(fleet.shm_dir.iterdir()) == []
    for step in ("000000000008", "000000000012"):
        # Each node wrote the checksums of its own ranks (one part each), then the step's
        # manifest, which lists no shard itself.
        folder = fleet.root / "objects" / job["id"] / step
        manifest = json.loads((folder / "manifest.json").read_bytes())
        assert (manifest["world_size"], manifest["shards"]) == (4, [])
        parts = sorted(folder.glob("manifest-r*.json"))
        assert [p.name for p in parts] == [
            "manifest-r00000-r00001.json",
            "manifest-r00002-r00003.json",
        ]
        assert [s["rank"] for p in parts for s in json.loads(p.read_bytes())["shards"]] == [
            0,
            1,
            2,
            3,
        ]

    # Both nodes let go of the ended job, so the broker keeps none of its catalogs (it
    # would hand a reconnecting node one per job the node ever ran) ...
    wait_for(
        lambda: not retained_catalogs(fleet, job["id"]),
        30,
        "the ended job's retained catalogs to be cleared",
    )
    # ... and a restarted supervisor does not publish them again.
    watcher = RawMqtt(fleet.broker.port)
    watcher.subscribe(wire.catalog_filter(job["id"]))
    assert fleet.supervisor is not None
    fleet.supervisor.stop()
    fleet.start_supervisor()
    fleet.wait_state("n01", "up")
    fleet.wait_state("n02", "up")
    time.sleep(2.0)
    watcher.close()
    assert [t for t, p in watcher.messages if p] == []
    assert committed(fleet, job["id"]) == wanted  # the catalog itself stays


def test_a_failed_jobs_nodes_free_its_ram_tier_once_the_linger_is_over(fleet: Fleet) -> None:
    start_two_racks(fleet, supervisor_extra="ckpt_failed_ram_linger_s = 5.0\n")
    job = fleet.submit(
        name="ckpt",
        nodes=2,
        ranks_per_node=2,
        workdir=str(REPO),
        command=tinylm("--steps", "100000", "--ckpt-every", "3"),
        checkpoint={"tiers": ["ram", "nvme"]},
        restart={"max_restarts": 0},
    )
    wait_for(
        lambda: any(t == ["nvme", "ram"] for t in committed(fleet, job["id"]).values()),
        90,
        "a step committed in RAM and on NVMe",
    )
    os.kill(wait_for(lambda: rank_pid(job["id"], 1), 10, "rank 1's process"), 9)
    fleet.wait_job(job["id"], "failed", timeout=60)

    # For a restart in place, the RAM tier stays a while (a job that failed keeps it) ...
    segments = sorted(p.name for p in fleet.shm_dir.glob(f"phalanx-{job['id']}-r*"))
    assert len(segments) >= 4, segments
    # ... then the nodes free it; NVMe keeps the committed step.
    wait_for(
        lambda: not any(fleet.shm_dir.glob(f"phalanx-{job['id']}-r*")),
        60,
        "the RAM tier of the failed job to be freed",
    )
    assert any(t == ["nvme"] for t in committed(fleet, job["id"]).values())
    wait_for(
        lambda: not retained_catalogs(fleet, job["id"]),
        30,
        "the failed job's retained catalogs to be cleared",
    )


# --- restarts -------------------------------------------------------------------------------


def rank_events(message: object) -> list[wire.RankEvent]:
    """The rank events of one message on a rank topic (an agent packs what queued up)."""
    if isinstance(message, wire.RankEvents):
        return list(message.events)
    return [message] if isinstance(message, wire.RankEvent) else []


class Gang:
    """A job of 2 nodes x 2 ranks that checkpointed, then lost a rank to ``kill -9``."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        # The job fails; its RAM tier stays for the restarts the test sends by hand. The
        # supervisor is gone by then: no catalog of those generations comes, and the ranks
        # restore from the last one the agents have after ckpt.catalog_wait_s.
        start_two_racks(
            fleet,
            supervisor_extra="ckpt_failed_ram_linger_s = 3600\n",
            agent_extra="catalog_wait_s = 1\n",
        )
        self.mqtt = RawMqtt(fleet.broker.port)
        self.mqtt.subscribe("phalanx/v1/node/+/rank")
        self.generation = 1
        job = fleet.submit(
            name="ckpt",
            nodes=2,
            ranks_per_node=2,
            workdir=str(REPO),
            command=tinylm("--steps", "100000", "--ckpt-every", "3"),
            checkpoint={"tiers": TIERS},
            restart={"max_restarts": 0},
        )
        self.job: str = job["id"]
        fleet.wait_job(self.job, "running", timeout=60)
        wait_for(
            lambda: any(t == sorted(TIERS) for t in committed(fleet, self.job).values()),
            90,
            "a step committed at every tier",
        )
        pid = wait_for(lambda: rank_pid(self.job, 1), 10, "rank 1's process")
        os.kill(pid, 9)
        fleet.wait_job(self.job, "failed", timeout=60)
        # The agents finish writing down what the ranks saved: wait for the newest step.
        self.step = wait_for(self._settled, 60, "the newest committed step at every tier")
        self.peers = {
            n: wire.PeerAddr(node=n, address=view["address"], http_port=view["http_port"])
            for n in ("n01", "n02")
            for view in [fleet.node(n)]
        }
        assert fleet.supervisor is not None
        fleet.supervisor.stop()
        self.saved = {
            rank: next(
                line["digest"]
                for line in rank_lines(
                    fleet, "n01" if rank < 2 else "n02", self.job, 1, rank, "ckpt_saved"
                )
                if line["ckpt_saved"] == self.step
            )
            for rank in range(4)
        }

    def _settled(self) -> int | None:
        """The newest step committed anywhere, once it is committed at every tier (a step
        that the killed rank never saved stays partial and does not count)."""

        def newest() -> int | None:
            return max((s for s, t in committed(self.fleet, self.job).items() if t), default=None)

        step = newest()
        if step is None or committed(self.fleet, self.job)[step] != sorted(TIERS):
            return None
        time.sleep(1.0)  # and stays so
        return step if newest() == step else None

    def restart(self) -> dict[int, dict[str, Any]]:
        """Start generation G+1 on the same nodes with the real start_ranks command (what
        the recovery controller will send); every rank restores and exits. Returns each
        rank's ``ckpt_restored`` line."""
        self.generation += 1
        gen, port = self.generation, free_port()
        for group, (node, buddy) in enumerate((("n01", "n02"), ("n02", "n01"))):
            args = wire.StartRanksArgs(
                job=self.job,
                generation=gen,
                command=tinylm("--steps", "1"),
                workdir=str(REPO),
                world_size=4,
                group_rank=group,
                master_addr="127.0.0.1",
                master_port=port,
                ranks=[wire.RankSlot(rank=2 * group + i, local_rank=i) for i in range(2)],
                ckpt=wire.CkptPlan(tiers=TIERS, buddy=self.buddy(node, buddy)),
            )
            self.mqtt.publish(wire.command_topic(node), wire.encode(wire.Command.new(node, args)))

        def exits() -> list[wire.RankEvent] | None:
            events = [
                e
                for t, p in self.mqtt.messages
                if t.endswith("/rank")
                for e in rank_events(wire.parse(t, p).message)
            ]
            mine = [
                e
                for e in events
                if e.job == self.job and e.generation == gen and e.event == "exited"
            ]
            return mine if len(mine) == 4 else None

        ended = wait_for(exits, 120, f"the 4 ranks of generation {gen} to exit")
        assert sorted((e.rank, e.code) for e in ended) == [(r, 0) for r in range(4)]
        return {
            rank: rank_lines(
                self.fleet, "n01" if rank < 2 else "n02", self.job, gen, rank, "ckpt_restored"
            )[-1]
            for rank in range(4)
        }

    def buddy(self, node: str, buddy: str) -> wire.PeerAddr:
        """``buddy``'s address with ``node``'s credential there, as the supervisor sends it."""
        keys = AgentKeys(self.fleet.agent_secret_file().read_text().strip())
        credential = keys.peer_credential(buddy, node)
        assert credential is not None
        return self.peers[buddy].model_copy(update={"token": SecretStr(credential)})

    def tiers_used(self, restored: dict[int, dict[str, Any]]) -> dict[int, str]:
        for rank, line in restored.items():
            assert line["ckpt_restored"] == self.step
            assert line["digest"] == self.saved[rank], f"rank {rank} restored other bits"
        return {rank: line["from"] for rank, line in restored.items()}

    def node_data(self, node: str) -> Path:
        return self.fleet.root / "nodes" / node / "data"


def test_a_rank_killed_and_restarted_on_its_node_restores_from_ram_bit_for_bit(
    fleet: Fleet,
) -> None:
    gang = Gang(fleet)

    used = gang.tiers_used(gang.restart())

    assert used == {0: "ram", 1: "ram", 2: "ram", 3: "ram"}


def test_restore_falls_through_nvme_peer_and_object_store_as_copies_go(fleet: Fleet) -> None:
    gang = Gang(fleet)
    step_dir = f"{gang.step:012d}"

    for segment in fleet.shm_dir.glob(f"phalanx-{gang.job}-r*.slot*"):
        segment.unlink()
    assert gang.tiers_used(gang.restart()) == {0: "nvme", 1: "nvme", 2: "nvme", 3: "nvme"}

    shard = gang.node_data("n01") / "ckpt" / gang.job / step_dir / "rank-00000.phx"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(data)
    assert gang.tiers_used(gang.restart()) == {0: "peer", 1: "nvme", 2: "nvme", 3: "nvme"}

    for segment in fleet.shm_dir.glob(f"phalanx-{gang.job}-r*.slot*"):
        segment.unlink()  # rank 0's copy from the peer was staged there
    for node in ("n01", "n02"):
        subprocess.run(["rm", "-rf", str(gang.node_data(node) / "ckpt" / gang.job)], check=True)
    assert gang.tiers_used(gang.restart()) == {0: "peer", 1: "peer", 2: "peer", 3: "peer"}
    # The agents staged those copies in their ranks' RAM slots: the next restart reads them.
    assert gang.tiers_used(gang.restart()) == {0: "ram", 1: "ram", 2: "ram", 3: "ram"}

    for segment in fleet.shm_dir.glob(f"phalanx-{gang.job}-r*.slot*"):
        segment.unlink()
    for node in ("n01", "n02"):
        subprocess.run(
            ["rm", "-rf", str(gang.node_data(node) / "ckpt-peer" / gang.job)], check=True
        )
    assert gang.tiers_used(gang.restart()) == {0: "object", 1: "object", 2: "object", 3: "object"}
