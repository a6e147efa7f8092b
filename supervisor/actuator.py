"""The actuator: what acts on a job's ranks and on its record.

Both the job controller (:mod:`supervisor.control.controller`: the queue, scheduling,
rank exits, stops) and the recovery (:mod:`supervisor.recovery`: a failed job's plan
carried out) act through it, and through nothing of each other: the recovery never
calls back into the controller. Its verbs:

* :meth:`Actuator.command` one node, :meth:`Actuator.command_gang` a job's reachable
  nodes, and wait for their acks;
* :meth:`Actuator.launch` a job's next generation on its nodes: the rendezvous, then
  the catalogs and the start orders together; it returns a :class:`Launched` (done,
  failed and why, or superseded by a cancel) and decides nothing about a failed launch;
* :meth:`Actuator.save`, :meth:`Actuator.save_soon`, :meth:`Actuator.event` and
  :meth:`Actuator.move` write the job's record and the event log.

Its attributes are the state both read: the jobs, the registry, the store, the settings,
the checkpoint catalog, the nodes' peer credentials, the spare pool of the last
scheduling pass (the controller keeps it current).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from phalanx import wire
from phalanx.agent_tokens import AgentKeys
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.publisher import CatalogPublisher
from supervisor.config import SupervisorSettings
from supervisor.errors import LaunchError
from supervisor.fleet.commands import CommandSender
from supervisor.fleet.registry import NodeState, Registry
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.store import Store

log = logging.getLogger(__name__)

MAX_WORLDS_KEPT = 16  # generations whose world size a job keeps (Job.worlds)
WRITTEN_WAIT_S = 1.0  # how long a launch's catalogs wait for its starts on the wire, at most

StartOrders = Callable[[Job, Sequence[str]], list[wire.StartRanksArgs]]


@dataclass(frozen=True, slots=True)
class Launched:
    """How a launch ended: ``ok`` (every start acknowledged, the job runs); failed, with
    the node it names and why (the job is still ``starting``: its caller decides); or
    neither, ``superseded``: the job left ``starting`` meanwhile (a cancel's stop owns it)."""

    ok: bool
    node: str | None = None
    why: str = ""

    @property
    def superseded(self) -> bool:
        return not self.ok and self.node is None


class Actuator:
    """Acts on ``jobs`` over ``send`` (a command and its ack); ``publisher`` sends the
    checkpoint catalogs; ``start_orders(job, nodes)`` writes each node's start order."""

    def __init__(
        self,
        jobs: dict[str, Job],
        store: Store,
        registry: Registry,
        settings: SupervisorSettings,
        *,
        send: CommandSender,
        publisher: CatalogPublisher,
        agent_keys: AgentKeys,
        start_orders: StartOrders,
        write_now: Callable[[], None] = lambda: None,
        written: Callable[[float], Awaitable[bool]] | None = None,
    ) -> None:
        self.jobs = jobs
        self._write_now = write_now
        self._written = written
        self.store = store
        self.registry = registry
        self.settings = settings
        self.agent_keys = agent_keys
        self.catalog: CheckpointCatalog = publisher.catalog
        self.spares: tuple[str, ...] = ()  # the spare pool of the last scheduling pass
        self.saves = 0  # job records saved: a job changed (the scheduler's skip reads it)
        self._send = send
        self._publisher = publisher
        self._start_orders = start_orders

    # --- commands ------------------------------------------------------------------

    async def command(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck:
        """Send one command and wait for its ack (see ``commands.CommandSender``)."""
        return await self._send(node, args, timeout=timeout)

    def reachable(self, nodes: Iterable[str]) -> list[str]:
        """Those of ``nodes`` the registry knows and does not hold offline."""
        known = self.registry.nodes
        return [
            n
            for n in nodes
            if (node := known.get(n)) is not None and node.state is not NodeState.OFFLINE
        ]

    async def command_gang(
        self, nodes: Sequence[str], args: wire.CommandArgsType, timeout: float
    ) -> list[wire.CommandAck | BaseException]:
        """Send ``args`` to each of ``nodes`` at once; each one's ack or what went wrong,
        in order."""
        return await asyncio.gather(
            *(self._send(n, args, timeout=timeout) for n in nodes), return_exceptions=True
        )

    # --- launch --------------------------------------------------------------------

    async def launch(
        self,
        job: Job,
        nodes: list[str],
        *,
        ack_grace_s: float = 0.0,
        on_issued: Callable[[], None] | None = None,
    ) -> Launched:
        """Launch the job's next generation on ``nodes``: ``starting``, a rendezvous port
        on rank 0's node, then every node's start order and right behind them the catalogs
        (an elastic job's catalogs first); ``running`` once every start is acknowledged. A
        recovery's launch is timed (its phases ``port``, then ``catalogs`` and ``starts``,
        which overlap) and its cold ranks kept. ``ack_grace_s``: how much longer a start's
        ack may take (its node may still be stopping the job's older ranks). ``on_issued``:
        called once every start order was handed to the broker link (not when the launch
        ends before that)."""
        spec = job.spec
        job.generation += 1
        job.nodes = nodes
        job.worlds[str(job.generation)] = job.world_size
        while len(job.worlds) > MAX_WORLDS_KEPT:
            del job.worlds[min(job.worlds, key=int)]
        job.ranks = [
            RankPlace(rank=i * spec.ranks_per_node + lr, node=n, local_rank=lr)
            for i, n in enumerate(nodes)
            for lr in range(spec.ranks_per_node)
        ]
        job.stop_target = None
        job.reason = ""
        self.move(job, JobState.STARTING, f"placed on {', '.join(nodes)}")
        self.event("job_starting", job, nodes=nodes, generation=job.generation)
        timeout = self.settings.command_timeout_s
        try:
            rank0 = self.registry.get(nodes[0])
            assert rank0.birth is not None
            job.master_addr = rank0.birth.address
            timed = job.recovery.phases if job.recovery is not None else {}
            t0 = time.perf_counter()
            port = self.registry.take_port(nodes[0])
            if port is None:
                ack = await self._send(nodes[0], wire.AllocPortArgs(), timeout=timeout)
                if ack.status != wire.AckStatus.DONE:
                    raise LaunchError(
                        f"node {nodes[0]} could not allocate a port: {ack.detail}", nodes[0]
                    )
                port = int(ack.result["port"])
                self.registry.port_given(nodes[0], port)
            job.master_port = port
            timed["port"] = round(time.perf_counter() - t0, 3)

            # The catalogs (this generation's restore step, or that there is none) go out
            # right behind the start orders: a rank asks its node what to restore only once
            # it runs, and the node waits for this generation's catalog
            # (agentd.ckpt.restores.CATALOG_WAIT_S). At 2,048 nodes a publish takes
            # seconds that the starts no longer wait behind, nor share the broker link
            # with: each start is handed to it before the first catalog is built. An
            # elastic job's orders carry the samples consumed up to the restore step: its
            # catalogs go out first.
            async def catalogs() -> None:
                t0 = time.perf_counter()
                await self._publisher.publish(job.id)
                timed["catalogs"] = round(time.perf_counter() - t0, 3)

            if job.spec.elastic is not None:
                await catalogs()
            orders = self._start_orders(job, nodes)

            issued = asyncio.Event()  # every start handed to the broker link

            async def starts() -> list[wire.CommandAck | BaseException]:
                t0 = time.perf_counter()
                sends = asyncio.gather(
                    *(
                        self._send(node, order, timeout=timeout + ack_grace_s)
                        for node, order in zip(nodes, orders, strict=True)
                    ),
                    return_exceptions=True,
                )
                written = False
                try:
                    # The gather made a task of each send, ready before this one: each
                    # publishes its order, up to its ack's wait, before this goes on.
                    await asyncio.sleep(0)
                    # Out to the broker now: the catalogs' build, next, would hold them
                    # in the link for its first slice (its reads and the restore step's
                    # choice: up to half a second at 2,048 nodes on a busy host).
                    self._write_now()
                    written = True
                    # And what the socket did not take at once (2 MB of orders at 2,048
                    # nodes) before the catalogs begin: their first slice held the rest
                    # 0.5 s (issue 22). Bounded: the catalogs matter too.
                    if self._written is not None:
                        await self._written(WRITTEN_WAIT_S)
                except asyncio.CancelledError:
                    sends.cancel()
                    raise
                finally:
                    if not written:
                        self._write_now()
                    issued.set()
                    if on_issued is not None:
                        on_issued()
                acks = await sends
                timed["starts"] = round(time.perf_counter() - t0, 3)
                return acks

            if job.spec.elastic is not None:
                acks = await starts()
            else:
                sending = asyncio.ensure_future(starts())
                try:
                    published: Exception | None = None
                    try:
                        await issued.wait()
                        await catalogs()
                    except Exception as exc:  # the starts go on regardless
                        published = exc
                    acks = await sending
                finally:
                    sending.cancel()  # the launch cancelled meanwhile: its starts with it
                if published is not None:
                    # Not the launch's failure: they go again, and the ranks' nodes wait
                    # for them (agentd.ckpt.restores.CATALOG_WAIT_S).
                    log.warning(
                        "job %s: generation %d's checkpoint catalogs did not all go out "
                        "with its start orders (%s): they go again",
                        job.id,
                        job.generation,
                        published,
                    )
                    self._publisher.publish_soon(job.id)
            problems, failed = [], []
            for node, result in zip(nodes, acks, strict=True):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                if isinstance(result, BaseException):
                    problems.append(f"{node}: {result}")
                    failed.append(node)
                elif result.status != wire.AckStatus.DONE:
                    problems.append(f"{node}: {result.detail}")
                    failed.append(node)
            if problems:
                raise LaunchError("; ".join(problems), failed[0])
            if job.recovery is not None:
                job.recovery.cold_ranks = cold_ranks(
                    [a for a in acks if isinstance(a, wire.CommandAck)]
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # LinkDown, a timeout, a bad ack: never stay in starting
            if job.state is not JobState.STARTING:
                return Launched(False)  # cancelled meanwhile: that stop owns the job now
            node = getattr(exc, "node", None) or job.nodes[0]
            return Launched(False, node=str(node), why=str(exc))
        if job.state is not JobState.STARTING:
            return Launched(False)  # cancelled while the ranks started: the cancel's stop
        job.started_at = time.time()
        if job.first_started_at is None:
            job.first_started_at = job.started_at
        self.move(job, JobState.RUNNING, f"world size {job.world_size}")
        self.event(
            "job_running",
            job,
            generation=job.generation,
            master=f"{job.master_addr}:{job.master_port}",
        )
        return Launched(True)

    # --- the record ----------------------------------------------------------------

    def move(self, job: Job, to: JobState, why: str) -> None:
        """Move ``job`` to state ``to`` (persisted, logged); a job that ended has its
        catalog published (its agents free its RAM tier)."""
        before = job.state
        job.move(to, why)
        self.save(job)
        log.info(
            "job %s: %s -> %s (%s)",
            job.id,
            before.value,
            to.value,
            why,
            extra={"job": job.id, "event": "job_state", "state": to.value},
        )
        if to.final:
            # Its agents free the RAM tier once the catalog says the job ended (a failed
            # job's, after ckpt_failed_ram_linger_s).
            self._publisher.publish_soon(job.id)

    def save(self, job: Job) -> None:
        """Persist the job's record."""
        self.saves += 1
        self.store.save_job(job.id, job.state.value, job.record())

    def save_soon(self, job: Job) -> None:
        """Persist the job's record soon (``Store.save_job_soon``): its JSON, 1.5 MB for a
        16,384-rank gang, is built once for a burst of changes, not once per rank."""
        self.saves += 1
        self.store.save_job_soon(job.id, lambda: job.state.value, job.record)

    def event(self, kind: str, job: Job, node: str | None = None, **detail: Any) -> None:
        """Record an event of ``job`` in the event log."""
        self.store.add_event(kind, node, {"job": job.id, **detail})


MAX_REASON = 200  # characters of an agent's reason kept
MAX_REASONS = 8  # distinct reasons kept (the rest counted under "other")
MAX_RANGES = 32  # rank ranges shown per reason (the rest counted)


def cold_ranks(acks: Iterable[wire.CommandAck]) -> dict[str, str] | None:
    """The ranks a launch's start acks say were launched cold, by reason: reason -> the
    ranks as ranges (``"0-3, 8"``), so a 16,384-rank gang's costs a line, not 16,384
    entries. None when no ack says (agents older than warm interpreters)."""
    by_reason: dict[str, list[int]] = {}
    said = False
    for ack in acks:
        cold = ack.result.get("cold")
        if not isinstance(cold, dict):
            continue
        said = True
        for rank, why in cold.items():
            if isinstance(rank, str) and rank.isdigit() and isinstance(why, str):
                by_reason.setdefault(why[:MAX_REASON], []).append(int(rank))
    if not said:
        return None
    ordered = sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    out = {why: rank_ranges(ranks) for why, ranks in ordered[:MAX_REASONS]}
    rest = [r for _, ranks in ordered[MAX_REASONS:] for r in ranks]
    if rest:
        out["other reasons"] = rank_ranges(rest)
    return out


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` as ``"0-3, 8"`` (at most ``MAX_RANGES`` ranges, then a count)."""
    spans: list[list[int]] = []
    for r in sorted(set(ranks)):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = [f"{a}-{b}" if b > a else str(a) for a, b in spans[:MAX_RANGES]]
    if len(spans) > MAX_RANGES:
        more = sum(b - a + 1 for a, b in spans[MAX_RANGES:])
        text.append(f"and {more} more")
    return ", ".join(text)
