"""The nineteen faults: how each is injected, and what the job must do after it.

Each scenario is ``inject(strike)``: it runs once the job has reached the seeded step, may
wait (a link down for a while) and must undo what it did to the fleet (a link back up, a
disk emptied) before it returns, so that the job can finish. ``expect`` is what the
driver checks at the end: the job's final state and which kind of recovery it took.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.rig.base import Fleet
from tests.rig.hosts import Host
from tests.rig.net import RigError
from tests.rig.shards import RAM_HEADER_NBYTES


@dataclass
class Strike:
    """What a fault needs: the fleet, the job, the seeded choices."""

    fleet: Fleet
    job_id: str
    rng: random.Random
    notes: dict[str, Any] = field(default_factory=dict)

    def job(self) -> dict[str, Any]:
        job: dict[str, Any] = self.fleet.client().get(f"/v1/jobs/{self.job_id}")
        return job

    def job_hosts(self) -> list[Host]:
        return [self.fleet.host(n) for n in self.job()["nodes"]]

    def victim(self) -> Host:
        """A host of the job, chosen by the seed (the same seed strikes the same host)."""
        host = self.rng.choice(sorted(self.job_hosts(), key=lambda h: h.name))
        self.notes["host"] = host.name
        return host

    def rank_on(self, host: Host) -> int:
        ranks = sorted(r["rank"] for r in self.job()["ranks"] if r["node"] == host.name)
        rank = self.rng.choice(ranks)
        self.notes["rank"] = rank
        return rank

    def kill_rank(self, rank: int) -> None:
        job = self.job()
        node = next((r["node"] for r in job["ranks"] if r["rank"] == rank), None)
        if node is None:
            raise RigError(f"rank {rank} of {self.job_id} is not placed")
        self.fleet.kill_rank(self.fleet.host(node), self.job_id, rank, job["generation"])

    def wait_generation(self, generation: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.job()["generation"] >= generation:
                return
            time.sleep(0.02)
        raise RigError(f"job {self.job_id} not relaunched within {timeout:.0f} s")


@dataclass(frozen=True)
class Fault:
    kind: str
    inject: Callable[[Strike], None]
    expect_state: str  # the job's final state
    recovery: str  # none | in-place | replaced | no-spare | any
    what: str  # the expectation, in words
    # More the scenario checks at the end: why it did not go as expected, or None.
    check: Callable[[Strike, dict[str, Any]], str | None] | None = None


def kill_rank(s: Strike) -> None:
    host = s.victim()
    s.kill_rank(s.rank_on(host))


def kill_agent(s: Strike) -> None:
    host = s.victim()
    s.fleet.kill(host, "agent")
    time.sleep(2.0)  # systemd's RestartSec: the unit comes back
    s.fleet.restart(host, "agent")


def _gpu_fault(name: str) -> Callable[[Strike], None]:
    def inject(s: Strike) -> None:
        host = s.victim()
        gpu = s.rng.randrange(2)
        s.notes["gpu"] = gpu
        s.fleet.inject_gpu(host, gpu, name)

    inject.__name__ = name.replace("-", "_")
    return inject


def link_cut(s: Strike) -> None:
    host = s.victim()
    host.run(*host.cut_link(10), timeout=30)


def partition(s: Strike) -> None:
    a, b = sorted(s.job_hosts(), key=lambda h: h.name)[:2]
    s.notes["hosts"] = [a.name, b.name]
    try:
        a.run(*a.block(s.fleet.data_address(b)))
        b.run(*b.block(s.fleet.data_address(a)))
        time.sleep(15)
    finally:
        a.run(*a.unblock(s.fleet.data_address(b)), check=False)
        b.run(*b.unblock(s.fleet.data_address(a)), check=False)


def slow_link(s: Strike) -> None:
    """100 ms of delay and 5 % loss (netem) on one job host for 20 s; where the kernel has
    no netem (this CI's), the link's rate capped at 512 kbit/s with a 500 ms queue."""
    host = s.victim()
    try:
        _slow_down(s, host)
        time.sleep(20)
    finally:
        host.run(*host.clear_link(), check=False)


def _slow_down(s: Strike, host: Host) -> None:
    """netem's 100 ms delay and 5 % loss on ``host``'s link, or where the kernel has no
    netem a tbf cap of 512 kbit/s with a 500 ms queue (undone by ``clear_link``)."""
    try:
        host.run(*host.slow_link(100, 5))
        s.notes["link"] = "netem delay 100ms loss 5%"
    except RigError as exc:
        if "unknown" not in str(exc):
            raise
        host.run(*host.throttle_link(512, 500))
        s.notes["link"] = "tbf 512kbit, 500 ms queue (no netem in this kernel)"


def broker_restart(s: Strike) -> None:
    ctl = s.fleet.daemon_host("broker")
    s.fleet.kill(ctl, "broker")
    time.sleep(3)
    s.fleet.restart(ctl, "broker")


def supervisor_restart(s: Strike) -> None:
    ctl = s.fleet.daemon_host("supervisor")
    s.fleet.kill(ctl, "supervisor")
    time.sleep(2)
    s.fleet.restart(ctl, "supervisor")


def disk_full(s: Strike) -> None:
    host = s.victim()
    try:
        s.notes["free_bytes"] = s.fleet.fill_disk(host)
        time.sleep(20)  # saves meet ENOSPC on this host's NVMe tier
    finally:
        s.fleet.unfill_disk(host)


def shard_corrupt(s: Strike) -> None:
    """Flip one byte of a rank's newest sealed shard where its restore looks first: its
    RAM slot and its NVMe file, then kill the rank. Its restore must find both flips and
    read another tier (``check_restored_elsewhere``)."""
    host = s.victim()
    rank = s.rank_on(host)
    slot, step, nbytes = s.fleet.newest_slot(host, s.job_id, rank)
    shard = s.fleet.nvme(host) / s.job_id / f"{step:012d}" / f"rank-{rank:05d}.phx"
    size = s.fleet.file_size(host, shard)
    if size is None:
        raise RigError(f"step {step} of rank {rank} is in RAM but not yet on NVMe ({shard})")
    s.fleet.flip(host, slot, RAM_HEADER_NBYTES, nbytes)  # the shard, not the slot's spare
    s.fleet.flip(host, shard, 0, size)
    s.notes.update(step=step, flipped=[str(slot), str(shard)])
    s.kill_rank(rank)


def check_restored_elsewhere(s: Strike, job: dict[str, Any]) -> str | None:
    """The flipped rank's next generation restored from neither flipped tier."""
    rank = s.notes.get("rank")
    lines = [
        json.loads(line)
        for g in range(2, int(job["generation"]) + 1)
        for line in s.fleet.rank_log({**job, "generation": g}, rank).splitlines()
        if line.startswith('{"ckpt_restored"')
    ]
    if not lines:
        return f"rank {rank} did not log its restore"
    s.notes["restored"] = lines[0]
    if lines[0]["from"] in ("ram", "nvme"):
        return f"rank {rank} restored from its flipped {lines[0]['from']} copy"
    return None


def peer_gone(s: Strike) -> None:
    """A job host's buddy is gone for good: its link down until the job ends. The job's
    other host loses its peer copies with it; the ranks restore from the other tiers."""
    host = s.victim()
    s.notes["cut_for_good"] = host.name
    s.fleet.cut_link_for_good(host)


def object_store_down(s: Strike) -> None:
    s.fleet.stop_object_store()  # SIGSTOP: every request hangs, the store is unreachable
    try:
        time.sleep(60)
    finally:
        s.fleet.continue_object_store()


def double_fault(s: Strike) -> None:
    first = s.victim()
    generation = s.job()["generation"]
    s.kill_rank(s.rank_on(first))
    # Struck while the first is recovered: the gang is relaunched, its ranks restoring.
    s.wait_generation(generation + 1, 30)
    others = [h for h in s.job_hosts() if h is not first] or [first]
    second = s.rng.choice(others)
    s.notes["second_host"] = second.name
    s.fleet.inject_gpu(second, 0, "ecc-dbe")


def fault_during_save(s: Strike) -> None:
    """Kill a rank while a step's shards are being written down to NVMe."""
    host = s.victim()
    step_dir = s.fleet.wait_new_step(host, s.job_id, 30)
    if step_dir is not None:  # a new step is being written down
        s.notes["step_dir"] = step_dir
    s.kill_rank(s.rank_on(host))


def _spare(s: Strike, what: str) -> Host:
    """The first spare outside the job (noted as ``spare``); a RigError without one."""
    job = s.job()
    spares = [n["id"] for n in s.fleet.client().get("/v1/nodes") if n.get("spare")]
    spares = [n for n in spares if n not in job["nodes"]]
    if not spares:
        raise RigError(f"no spare to {what}")
    spare = s.fleet.host(spares[0])
    s.notes["spare"] = spare.name
    return spare


def bad_spare(s: Strike) -> None:
    """A GPU fails on a job host, and the spare that would replace it fails too."""
    host = s.victim()
    spare = _spare(s, "break")
    s.fleet.inject_gpu(host, 0, "ecc-dbe")
    s.fleet.inject_gpu(spare, 1, "ecc-dbe")


def slow_spare(s: Strike) -> None:
    """A GPU fails on a job host while the spare's link is slow (netem delay and loss, or
    tbf where the kernel has no netem): the spare's link from the job's other node carries
    a fraction of the fleet's, so it does not join, and another node replaces the host."""
    host = s.victim()
    job = s.job()
    spare = _spare(s, "slow down")
    try:
        _slow_down(s, spare)
        s.fleet.inject_gpu(host, 0, "ecc-dbe")
        s.wait_generation(job["generation"] + 1, 180)  # relaunched, on another node
    finally:
        spare.run(*spare.clear_link(), check=False)


def check_slow_spare_refused(s: Strike, job: dict[str, Any]) -> str | None:
    """The slow spare was refused for its link, and is not in the gang."""
    spare = s.notes.get("spare")
    if spare in job["nodes"]:
        return f"the spare {spare}, whose link was slow, joined the gang"
    events = s.fleet.client().get(f"/v1/events?job={s.job_id}&limit=2000")
    refused = [
        e["detail"].get("reason", "")
        for e in events
        if e["kind"] == "spare_rejected" and e.get("node") == spare
    ]
    if not any("_p2p:" in reason for reason in refused):
        return f"the spare {spare} was not refused for its link (refusals: {refused})"
    s.notes["refused"] = next(r for r in refused if "_p2p:" in r)
    return None


def code_error(s: Strike) -> None:
    """Nothing to inject: the training code raises at the seeded step, every time."""


FAULTS: dict[str, Fault] = {
    f.kind: f
    for f in (
        Fault("kill-rank", kill_rank, "succeeded", "in-place", "restarts in place"),
        Fault("kill-agent", kill_agent, "succeeded", "any", "agent back; gang restarted"),
        Fault("ecc-dbe", _gpu_fault("ecc-dbe"), "succeeded", "replaced", "spare takes over"),
        Fault("xid-79", _gpu_fault("xid-79"), "succeeded", "replaced", "spare takes over"),
        Fault("thermal", _gpu_fault("thermal"), "succeeded", "any", "the job goes on"),
        Fault("link-cut", link_cut, "succeeded", "any", "node offline: recovered"),
        Fault("partition", partition, "succeeded", "any", "hang detected: recovered"),
        Fault("slow-link", slow_link, "succeeded", "any", "the job goes on"),
        Fault("broker-restart", broker_restart, "succeeded", "none", "no recovery at all"),
        Fault("supervisor-restart", supervisor_restart, "succeeded", "none", "no recovery"),
        Fault("disk-full", disk_full, "succeeded", "any", "other tiers carry the job"),
        Fault(
            "shard-corrupt",
            shard_corrupt,
            "succeeded",
            "in-place",
            "both flips found; restored from peer or object",
            check_restored_elsewhere,
        ),
        Fault("peer-gone", peer_gone, "succeeded", "replaced", "spare; other tiers restore"),
        Fault("object-store-down", object_store_down, "succeeded", "none", "the job goes on"),
        Fault("double-fault", double_fault, "succeeded", "any", "both recovered"),
        Fault("fault-during-save", fault_during_save, "succeeded", "in-place", "restores"),
        Fault("bad-spare", bad_spare, "succeeded", "replaced", "another node replaces"),
        Fault(
            "slow-spare",
            slow_spare,
            "succeeded",
            "replaced",
            "the spare's slow link keeps it out; another node replaces",
            check_slow_spare_refused,
        ),
        Fault("code-error", code_error, "failed", "no-spare", "fails fast, no spare used"),
    )
}
