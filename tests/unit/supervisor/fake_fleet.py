"""One fake fleet for the supervisor's unit tests (issue 21).

The controller, its store, registry, checkpoint catalog and publisher, burn-ins, planner
and scheduler are real; the fleet around them is not. Its nodes are born in the registry,
and the commands the controller sends go to a recording ``send`` that answers as the test
scripted (:meth:`FakeFleet.answer`, :meth:`FakeFleet.hold`): done, refused, expired,
never acknowledged, or held until the test releases it. What the nodes say back (rank
events, heartbeats, last wills, hang reports) the test delivers with the helpers here.

Nothing runs the controller's loop: a test turns it (:meth:`FakeFleet.tick`) where the
loop would, and waits for a condition (:meth:`FakeFleet.until`), never for a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from phalanx import wire
from phalanx.jobspec import JobSpec, validate_spec
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.publisher import CatalogPublisher
from supervisor.config import SupervisorSettings
from supervisor.control.controller import JobController
from supervisor.errors import CommandTimeout
from supervisor.fleet.registry import Registry
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.store import Event, Store
from tests.wait import settle, until

RPN = 2  # ranks (GPUs) per node

How = Literal["done", "refused", "expired", "never"]


def birth(
    node: str, *, rack: str = "r1", gpus: int = 2, health: wire.Health | None = None, seq: int = 1
) -> wire.NodeBirth:
    """A node's birth; its GPUs' gauges by default: 41.0 and 57.5 C, ECC 2/0 and 3/1."""
    if health is None:
        health = wire.Health(
            status=wire.HealthStatus.OK,
            gpus=[
                wire.GpuGauges(
                    index=i,
                    temperature_c=41.0 + 16.5 * (i % 2),
                    ecc_sbe_volatile=2 + i % 2,
                    ecc_dbe_volatile=i % 2,
                )
                for i in range(gpus)
            ],
        )
    return wire.NodeBirth(
        node=node,
        seq=seq,
        hostname=f"{node}.example",
        address="10.0.0.1",
        http_port=9400,
        gpus=[
            wire.GpuDescriptor(index=i, uuid=f"GPU-{node}-{i}", model="H100", memory_bytes=2**30)
            for i in range(gpus)
        ],
        gpu_backend="sim",
        topology=wire.Topology(rack=rack),
        version="0.1.0",
        started_at=1700000000.0,
        health=health,
    )


OK = wire.Health(status=wire.HealthStatus.OK)


def heartbeat(
    node: str,
    *,
    seq: int = 1,
    n: int = 1,
    health: wire.Health = OK,
    jobs: Iterable[wire.JobRanks] = (),
    port: int | None = None,
    sent_at: float | None = None,
) -> wire.Heartbeat:
    """A heartbeat of ``node`` (birth ``seq``), healthy by default."""
    return wire.Heartbeat(
        node=node,
        seq=seq,
        n=n,
        sent_at=time.time() if sent_at is None else sent_at,
        health=health,
        jobs=list(jobs),
        port=port,
    )


def drain_health(code: str = "ecc_dbe", detail: str = "double-bit ECC error") -> wire.Health:
    """A health sample whose reason drains the node (an agent's hardware fault)."""
    return wire.Health(
        status=wire.HealthStatus.DRAIN,
        reasons=[wire.Reason(code=code, severity="drain", gpu=0, detail=detail)],
    )


def job_spec(**over: Any) -> JobSpec:
    """A gang job's spec: ``nodes`` x ``RPN`` ranks of ``true``; ``over`` replaces fields.
    No backoff between restarts (``restart.backoff``: a test never waits for a clock)."""
    raw: dict[str, Any] = {
        "name": "recovers",
        "team": "t",
        "command": ["true"],
        "workdir": "/tmp",
        "nodes": 2,
        "ranks_per_node": RPN,
        "restart": {"max_restarts": 3, "backoff": 0},
    }
    raw.update(over)
    return validate_spec(raw)


@dataclass(frozen=True)
class Sent:
    """One command the controller sent, in order."""

    node: str
    op: str
    generation: int  # the job generation it names (0: none)
    args: wire.CommandArgsType


@dataclass
class _Script:
    op: str
    node: str | None  # None: every node
    how: How
    result: dict[str, Any] | None
    detail: str
    held: asyncio.Event | None
    times: int | None  # None: every time


# What a command is answered with when no script says otherwise.
DEFAULT_RESULTS: dict[str, dict[str, Any]] = {
    "alloc_port": {"port": 29500},
    "burn_in": {"passed": True, "reasons": [], "checks": []},
    "start_ranks": {"pids": {}},
}


class FakeFleet:
    """``nodes`` born in the registry of a real :class:`JobController` whose ``send`` is
    :meth:`send`. ``settings``: fields of :class:`SupervisorSettings` (its ``state_dir`` is
    ``tmp_path``); ``offline_confirmed``: what the controller's ``offline_confirmed`` says
    of every node (True: an offline node is offline for sure)."""

    def __init__(
        self,
        tmp_path: Path,
        nodes: Iterable[str],
        *,
        gpus: int = RPN,
        offline_confirmed: bool = True,
        born: bool = True,
        **settings: Any,
    ) -> None:
        self.tmp_path = tmp_path
        self.settings = SupervisorSettings(state_dir=tmp_path, **settings)
        self.store = Store(tmp_path / "state.db")
        self.registry = Registry(self.store, offline_after_s=self.settings.offline_after_s)
        if born:
            for node in nodes:
                self.registry.on_birth(birth(node, gpus=gpus))
        self.sent: list[Sent] = []
        # Sends and acks as they happened: ("sent" | "acked", node, op).
        self.log: list[tuple[str, str, str]] = []
        self._scripts: list[_Script] = []
        self._held: list[asyncio.Event] = []
        self.confirmed = offline_confirmed
        self.job: Job = None  # type: ignore[assignment]  # the job submitted or set running
        # Set: the catalogs' publish waits for it (cleared by a test to hold them).
        self.catalogs_out = asyncio.Event()
        self.catalogs_out.set()
        self._held.append(self.catalogs_out)
        self.catalogs_refused = 0  # so many catalogs' publishes fail (the broker's error)
        # Set: what was published is all on the wire (the link's written); cleared by a
        # test, the socket is full until it is set again, or the wait's timeout.
        self.on_the_wire = asyncio.Event()
        self.on_the_wire.set()
        self._held.append(self.on_the_wire)
        self.publisher = CatalogPublisher(
            CheckpointCatalog(self.store),
            self._publish,
            job=lambda job_id: self.ctl.jobs.get(job_id),
            registry=self.registry,
            ram_linger_s=900.0,
        )
        self.ctl = JobController(
            self.store,
            self.registry,
            self.settings,
            send=self.send,
            publisher=self.publisher,
            offline_confirmed=lambda since: self.confirmed,
            # the link's write_now: what was published goes to the broker now
            write_now=lambda: self.log.append(("written", "", "")),
            written=self._written,
        )
        self._closed = False
        self._restarted: list[FakeFleet] = []  # closed with this one

    async def _written(self, timeout: float) -> bool:
        """The link's ``written``: logged as ("on the wire", "", "") once
        :attr:`on_the_wire` is set, within ``timeout``."""
        try:
            await asyncio.wait_for(self.on_the_wire.wait(), timeout)
        except TimeoutError:
            return False
        self.log.append(("on the wire", "", ""))
        return True

    async def _publish(self, topic: str, payload: bytes, **kw: Any) -> None:
        """The link's publish: a checkpoint catalog goes nowhere (no node listens here),
        once :attr:`catalogs_out` is set; logged as ("catalog", node, generation)."""
        await self.catalogs_out.wait()
        if self.catalogs_refused > 0:
            self.catalogs_refused -= 1
            raise RuntimeError("the broker refused the publish")
        if payload:
            catalog = wire.parse(topic, payload).message
            if isinstance(catalog, wire.CkptCatalog):
                self.log.append(("catalog", catalog.node, str(catalog.generation)))

    # --- the nodes' side of a command ---------------------------------------------

    def answer(
        self,
        op: str,
        how: How = "done",
        *,
        node: str | None = None,
        result: dict[str, Any] | None = None,
        detail: str = "",
        times: int | None = None,
    ) -> None:
        """Answer ``op`` (on ``node``, or on every node) so from now on (``times``: that
        many times, then as before): ``done`` with ``result`` (else the default),
        ``refused`` (a failed ack saying ``detail``), ``expired``, or ``never`` (no ack:
        the sender's timeout, at once). The latest script that matches wins."""
        self._scripts.append(_Script(op, node, how, result, detail, None, times))

    def hold(self, op: str, *, node: str | None = None, times: int | None = None) -> asyncio.Event:
        """Hold every ``op`` command (on ``node``; ``times``: that many) until the event
        returned is set, then answer it as the other scripts say. :meth:`close` releases
        whatever is still held."""
        held = asyncio.Event()
        self._held.append(held)
        self._scripts.append(_Script(op, node, "done", None, "", held, times))
        return held

    def _script(self, node: str, op: str, *, holds: bool = True) -> _Script | None:
        """The latest script for ``op`` on ``node`` (``holds``: a hold too), one of its
        ``times`` spent."""
        for script in reversed(self._scripts):
            if script.op == op and script.node in (None, node) and (holds or not script.held):
                if script.times is not None:
                    script.times -= 1
                    if script.times <= 0:
                        self._scripts.remove(script)
                return script
        return None

    async def send(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck:
        """The controller's ``send``: record the command, answer it as scripted."""
        self.sent.append(Sent(node, args.op, int(getattr(args, "generation", 0)), args))
        self.log.append(("sent", node, args.op))
        script = self._script(node, args.op)
        if script is not None and script.held is not None:
            await script.held.wait()
            script = self._script(node, args.op, holds=False)  # answered as the rest say
        how = script.how if script is not None else "done"
        if how == "never":
            raise CommandTimeout(node, args.op, f"c{len(self.sent)}", timeout or 0.0)
        status = {
            "done": wire.AckStatus.DONE,
            "refused": wire.AckStatus.FAILED,
            "expired": wire.AckStatus.EXPIRED,
        }[how]
        result: dict[str, Any] = {}
        if how == "done":
            result = dict(
                script.result
                if script is not None and script.result is not None
                else DEFAULT_RESULTS.get(args.op, {})
            )
        self.log.append(("acked", node, args.op))
        return wire.CommandAck(
            id=f"c{len(self.sent)}",
            node=node,
            status=status,
            detail=script.detail if script is not None else "",
            result=result,
            acked_at=time.time(),
        )

    # --- jobs -----------------------------------------------------------------------

    def submit(self, **spec: Any) -> Job:
        """Submit a job (``job_spec(**spec)``) and turn the loop once: placed, if it fits."""
        self.job = self.ctl.submit(job_spec(**spec))
        self.tick()
        return self.job

    def running(
        self, gang: list[str], *, job_id: str = "j-1", generation: int = 1, **spec: Any
    ) -> Job:
        """A job already running ``generation`` on ``gang`` (RPN ranks a node), started ten
        minutes ago, as a supervisor that launched it knows it."""
        spec.setdefault("nodes", len(gang))
        job = Job(
            job_id,
            job_spec(**spec),
            state=JobState.RUNNING,
            generation=generation,
            nodes=list(gang),
            ranks=[
                RankPlace(rank=n * RPN + lr, node=node, local_rank=lr)
                for n, node in enumerate(gang)
                for lr in range(RPN)
            ],
            started_at=time.time() - 600,
        )
        self.ctl.jobs[job_id] = job
        self.job = job
        return job

    def tick(self) -> None:
        """One turn of the controller's loop (what its wake leads to)."""
        self.ctl.tick()

    # --- what the nodes report ------------------------------------------------------

    def rank_event(self, rank: int, event: str, *, job: Job | None = None, **kw: Any) -> None:
        """Deliver a rank event of ``rank`` of ``job``'s current generation, from its node."""
        job = job or self.job
        place = job.place(rank)
        assert place is not None, f"job {job.id} has no rank {rank}"
        fields: dict[str, Any] = {"generation": job.generation, "at": time.time(), **kw}
        self.ctl.on_rank_event(
            wire.RankEvent(node=place.node, job=job.id, rank=rank, event=event, **fields)  # type: ignore[arg-type]
        )

    def exit(self, rank: int, code: int | None = 1, *, job: Job | None = None, **kw: Any) -> None:
        """Rank ``rank`` exited with ``code`` (or ``signal=``)."""
        self.rank_event(rank, "exited", job=job, code=code, **kw)

    def hang(
        self,
        node: str,
        rank: int,
        *,
        job: Job | None = None,
        step: int = 40,
        idle_s: float = 30.0,
        stopped: bool = False,
        detail: str = "",
        flight: Iterable[wire.FlightPoint] = (),
    ) -> None:
        """``node``'s agent reports its ranks of the job hung, naming ``rank`` (as the
        rank furthest behind, or ``stopped``)."""
        job = job or self.job
        self.ctl.on_rank_event(
            wire.RankEvent(
                node=node,
                job=job.id,
                generation=job.generation,
                rank=rank,
                event="hung",
                step=step,
                stopped=stopped,
                idle_s=idle_s,
                detail=detail or f"no step for {idle_s:.1f}s; rank {rank} silent longest",
                flight=list(flight),
                at=time.time(),
            )
        )

    def beat(self, node: str, **kw: Any) -> None:
        """A heartbeat of ``node`` (``heartbeat(node, **kw)``), as the daemon takes one."""
        known = self.registry.nodes.get(node)
        before = known.state if known is not None else None
        beat = heartbeat(node, **kw)
        if self.registry.on_heartbeat(beat):
            self.ctl.on_heartbeat(beat)
            if self.registry.nodes[node].state != before:
                self.ctl.wake()

    def will(self, node: str, *, cause: Literal["lost", "shutdown"] = "lost") -> None:
        """``node``'s last will (``lost``) or clean shutdown, then a turn of the loop."""
        seq = self.registry.nodes[node].birth_seq
        self.registry.on_death(wire.NodeDeath(node=node, seq=seq, cause=cause))
        self.ctl.wake()
        self.tick()

    # --- what the controller did ----------------------------------------------------

    def ops(self, op: str) -> list[tuple[str, int]]:
        """(node, generation) of every ``op`` command sent, in order."""
        return [(s.node, s.generation) for s in self.sent if s.op == op]

    def args(self, op: str) -> list[Any]:
        """The arguments of every ``op`` command sent, in order."""
        return [s.args for s in self.sent if s.op == op]

    @property
    def ops_sent(self) -> list[str]:
        return [s.op for s in self.sent]

    def first(self, what: str, node: str | None, op: str) -> int:
        """Where in :attr:`log` the first ``what`` ("sent" or "acked") of ``op`` (on
        ``node``, or any) is; -1: none."""
        for i, (w, n, o) in enumerate(self.log):
            if w == what and o == op and node in (None, n):
                return i
        return -1

    def last(self, what: str, node: str | None, op: str) -> int:
        """Where in :attr:`log` the last ``what`` of ``op`` (on ``node``, or any) is."""
        found = -1
        for i, (w, n, o) in enumerate(self.log):
            if w == what and o == op and node in (None, n):
                found = i
        return found

    def events(self, kind: str | None = None, job: Job | None = None) -> list[Event]:
        """The job's events in the store (``kind``: of that kind only), oldest first."""
        self.store.flush()
        found = self.store.events(job=(job or self.job).id, limit=1000)
        return [e for e in found if kind is None or e.kind == kind]

    def kinds(self, job: Job | None = None) -> list[str]:
        return [e.kind for e in self.events(job=job)]

    def record(self, job: Job | None = None) -> dict[str, Any]:
        """The job's record as the store keeps it (its recovery, incidents, restarts)."""
        job = job or self.job
        self.store.flush()
        rec: dict[str, Any] = self.store.load_jobs()[job.id]
        return rec

    async def until(self, what: Callable[[], object], timeout: float = 10.0) -> None:
        """Wait until ``what()`` is true; fail after ``timeout`` s naming what was sent."""
        await until(what, timeout, lambda: f"the condition; sent {self.sent}")

    async def settle(self, turns: int = 20) -> None:
        """Let every task that can run do so (``tests.wait.settle``): before asserting
        that something did not happen."""
        await settle(turns)

    # --- lifecycle ------------------------------------------------------------------

    async def restart(self, **settings: Any) -> FakeFleet:
        """The supervisor restarted: this controller stops where it is (nothing it held is
        answered), and a new one on the same store, registry records and scripts resumes
        the jobs (:meth:`JobController.resume`). ``settings`` as for the first."""
        await self._stop_controller(release=False)
        nodes = list(self.registry.nodes)
        again = FakeFleet(
            self.tmp_path, nodes, born=False, offline_confirmed=self.confirmed, **settings
        )
        for node in self.registry.nodes.values():  # their retained births, read again
            if node.birth is not None and node.online:
                again.registry.on_birth(node.birth)
        again._scripts = [s for s in self._scripts if s.held is None]
        again.job = again.ctl.jobs[self.job.id] if self.job is not None else None  # type: ignore[assignment]
        again.ctl.resume()
        self._restarted.append(again)
        return again

    async def _stop_controller(self, *, release: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if release:
            for held in self._held:
                held.set()
        self.ctl.close()
        await self.ctl.shutdown(0.0)
        self.publisher.stop()
        await self.publisher.shutdown(0.0)
        self.publisher.close()
        self.store.close()

    async def close(self) -> None:
        """Release what is held, cancel what still runs, close the store (and those of the
        supervisors that took over from this one: :meth:`restart`)."""
        await self._stop_controller(release=True)
        for again in self._restarted:
            await again.close()
