"""Simulated agents for ``bench/fleet_scale.py``: many nodes' wire side in one process.

    python bench/fleet_sim.py --port PORT --first 0 --count 512 [--gpus 8] ...

Each simulated node is a real agent's wire side without processes, built from the
agent's own parts: an :class:`~phalanx.link.MqttLink` (its birth on every connect, a
last will naming the birth's sequence, a persistent session), the agent's
:class:`~phalanx.link.Outbox` for rank events and checkpoint landings (gated on the
supervisor's retained status, as the agent's are), its :class:`~agentd.commands.CommandLedger`
for commands (at most once, never late, acked), its :class:`~agentd.health.HealthClassifier`
to turn a GPU sample into health (an ECC fault is a sample with an uncorrected error) and
its :class:`~agentd.metrics.MetricsWindow` to fold the ranks' step reports into metrics
batches. What it does not run is rank processes: it answers start and stop orders as
the agent would (a ``restored`` event per rank once its generation's checkpoint catalog
is here, as a real rank waits for it, then ``stepped``; an ``exited`` one per rank at a
stop) and makes its ranks step on a shared clock, so that
every node checkpoints the same steps and lands them at every tier of the job's plan.

The process takes orders on stdin, one JSON object a line (``{"op": "die", "node": N}``:
the node's connection is cut without a DISCONNECT, so the broker sends its will;
``ecc``: an uncorrected ECC error on GPU 0; ``hang``: the node reports its ranks of a
job hung; ``report``: counters; ``quit``) and writes JSON lines on stdout: ``start``
and ``stop`` orders as they arrive, and the answer to ``report``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import resource
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentd.ckpt.restores import CATALOG_WAIT_S
from agentd.commands import CommandLedger
from agentd.config import Thresholds
from agentd.gpu.base import GpuSample, NodeSample
from agentd.health import HealthClassifier
from agentd.metrics import MetricsWindow
from phalanx import wire
from phalanx.link import MqttLink, Outbox, Will
from phalanx.loopwatch import LoopWatch
from phalanx.progress import StepReport
from phalanx.settings import MqttSettings

log = logging.getLogger("fleet_sim")

SHARD_BYTES = 2 * 2**30  # what a landing says a rank's shard weighs (nothing is written)
LINK_MB_S = 12_500.0  # what a link probe says it measured (100 Gb/s)
TIER_DELAY_S = {"ram": 0.0, "nvme": 0.5, "peer": 1.0, "object": 2.0}  # after the save


def emit(**record: Any) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


class CountingOutbox(Outbox):
    """The agent's outbox, counting what the broker took (and when a landing was)."""

    def __init__(
        self, sim: Sim, link: MqttLink, topic: str, what: str, gate: asyncio.Event, pack: Any
    ) -> None:
        super().__init__(link, topic, what, gate=gate, pack=pack)
        self.sim = sim
        self.kind = what

    async def _send_first(self, timeout: float, connection: int | None = None) -> int:
        head = list(itertools.islice(self._queue, wire.MAX_LANDINGS_BATCHED))
        # When the node handed them to its link, not when the broker's acknowledgement
        # came back: that waits for this process's loop, up to seconds behind at 2,048
        # nodes, and a step's catalogs then seemed out before its last landing.
        handed = time.time()
        count = await super()._send_first(timeout, connection)
        self.sim.sent[self.kind] += count
        for message in head[:count]:
            if isinstance(message, wire.CkptLanding) and message.event == "landed":
                key = (message.job, message.step)
                self.sim.last_landing[key] = max(self.sim.last_landing.get(key, 0.0), handed)
        return count


@dataclass
class Gen:
    job: str
    generation: int
    ranks: list[int]
    tiers: list[str]
    buddy: str | None
    interval_s: float
    restore_step: int | None = None
    stepped: bool = False
    last_step: int | None = None
    keep: dict[str, int] = field(default_factory=dict)
    saved: set[int] = field(default_factory=set)
    committed: dict[str, set[int]] = field(default_factory=dict)  # tier -> steps seen
    deleted: set[tuple[str, int]] = field(default_factory=set)
    # ``command: ["sim", "--steps", "N"]``: its ranks exit 0 after N steps (a job that
    # finishes); None: they train until stopped.
    steps: int | None = None
    first_step: int | None = None
    # Started before this generation's catalog came: its ranks wait for it to learn their
    # restore step, as a real rank asks its agent (``agentd.ckpt.restores``); after
    # ``CATALOG_WAIT_S`` they restore from an older one, as the agent answers then, or
    # fail without any.
    restoring_since: float | None = None


class SimAgent:
    def __init__(self, sim: Sim, node: str, rack: str) -> None:
        self.sim = sim
        self.node = node
        self.rack = rack
        self.seq = 0
        self.beats = 0
        self.dead = False
        self.health = sim.ok_health
        self.classifier = HealthClassifier(Thresholds(), sim.gpus)
        self.gens: dict[str, Gen] = {}
        self.catalogs: dict[str, wire.CkptCatalog] = {}
        self.seen_complete: set[tuple[str, int]] = set()
        self.ledger = CommandLedger(node, self._execute)
        self.metrics = MetricsWindow(node)
        self.link = MqttLink(
            sim.settings,
            f"agentd-{node}",
            subscriptions=wire.agent_subscriptions(node),
            handler=self._on_message,
            will=self._will,
            on_connect=self._on_connect,
            persistent_session=True,
        )
        self.supervisor_known = asyncio.Event()
        self.rank_events = CountingOutbox(
            sim, self.link, wire.rank_topic(node), "rank", self.supervisor_known, sim.pack_ranks
        )
        self.landings = CountingOutbox(  # packed as the agent packs them
            sim, self.link, wire.ckpt_topic(node), "ckpt", self.supervisor_known, sim.pack
        )
        self.metrics_out = CountingOutbox(
            sim, self.link, wire.metrics_topic(node), "metrics", self.supervisor_known, None
        )
        self.tasks: list[asyncio.Task[None]] = []
        self.running: set[asyncio.Task[Any]] = set()  # commands and saves in flight

    def spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    # --- the link ---------------------------------------------------------------

    async def start(self) -> None:
        await self.link.__aenter__()
        for loop in (
            self._heartbeats,
            self._metrics,
            self.rank_events.run,
            self.landings.run,
            self.metrics_out.run,
        ):
            self.tasks.append(asyncio.create_task(loop()))

    def _will(self) -> Will:
        self.seq = max(self.seq + 1, int(time.time() * 1000))
        death = wire.NodeDeath(node=self.node, seq=self.seq, cause="lost")
        return Will(wire.death_topic(self.node), wire.encode(death), retain=True)

    def birth(self) -> wire.NodeBirth:
        return wire.NodeBirth(
            node=self.node,
            seq=self.seq,
            hostname=self.node,
            address="127.0.0.1",
            http_port=9400,
            gpus=self.sim.gpu_descriptors(self.node),
            gpu_backend="sim",
            topology=wire.Topology(rack=self.rack),
            version="fleet-sim",
            started_at=self.sim.started_at,
            health=self.health,
            features=[wire.FEATURE_PROBE_BOTH_WAYS],
        )

    async def _on_connect(self) -> None:
        self.supervisor_known.clear()
        await self.link.publish(wire.birth_topic(self.node), wire.encode(self.birth()), retain=True)
        await self.heartbeat()

    async def heartbeat(self) -> None:
        beat = wire.Heartbeat(
            node=self.node,
            seq=self.seq,
            n=self.beats,
            sent_at=time.time(),
            health=self.health,
            jobs=[
                wire.JobRanks(job=g.job, generation=g.generation, ranks=g.ranks)
                for g in self.gens.values()
            ],
            port=random.randint(20000, 60999),  # as an agent's free port would be
        )
        self.beats += 1
        await self.link.publish(wire.heartbeat_topic(self.node), wire.encode(beat), qos=0)

    async def _heartbeats(self) -> None:
        await asyncio.sleep(random.uniform(0, self.sim.heartbeat_s))
        while True:
            if self.link.connected:
                with contextlib.suppress(Exception):
                    await self.heartbeat()
            await asyncio.sleep(self.sim.heartbeat_s)

    async def _metrics(self) -> None:
        await asyncio.sleep(random.uniform(0, wire.METRICS_INTERVAL_S))
        while True:
            await asyncio.sleep(wire.METRICS_INTERVAL_S)
            if self.sim.quiet:
                continue
            # As the agent (Agent.queue_metrics): the window kept while the link is down or
            # its broker has not shown the supervisor's session yet; its outbox, QoS 1.
            if not self.link.connected or not self.supervisor_known.is_set():
                continue
            for batch in self.metrics.flush(time.time()):
                self.metrics_out.put(batch)

    def die(self) -> None:
        """The node is gone without a word: its socket closes, the broker sends its will."""
        self.dead = True
        for task in self.tasks:
            task.cancel()
        client = self.link._client
        sock = client._client.socket() if client is not None else None
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self.link._task is not None:
            self.link._task.cancel()

    # --- inbound ----------------------------------------------------------------

    async def _on_message(self, topic: str, payload: bytes) -> None:
        if self.dead:
            return
        try:
            inbound = wire.parse(topic, payload)
        except wire.WireError as exc:
            log.warning("dropped: %s", exc)
            return
        msg = inbound.message
        if isinstance(msg, wire.SupervisorStatus):
            self.supervisor_known.set()
        elif isinstance(msg, wire.CkptCatalog):
            self._on_catalog(msg)
        elif isinstance(msg, wire.Command):
            self.spawn(self._run_command(msg))

    def _on_catalog(self, catalog: wire.CkptCatalog) -> None:
        self.catalogs[catalog.job] = catalog
        gen = self.gens.get(catalog.job)
        tiers = set(gen.tiers) if gen is not None else {"ram", "nvme", "peer", "object"}
        now = time.time()
        for step in catalog.steps:
            key = (catalog.job, step.step)
            if key not in self.seen_complete and tiers <= set(step.committed):
                self.seen_complete.add(key)
                self.sim.catalogs.setdefault(key, []).append(round(now, 4))
        if gen is not None:
            if gen.restoring_since is not None and catalog.generation >= gen.generation:
                self._restored(gen, catalog, now)
            self._retain(gen, catalog, now)
        if catalog.ended and catalog.job not in self.gens:
            self.landings.put(wire.CkptReleased(node=self.node, job=catalog.job, at=now))

    def _retain(self, gen: Gen, catalog: wire.CkptCatalog, now: float) -> None:
        """Retention as the agent's engine applies it: past the ``keep`` newest committed
        steps of a tier, each rank's shard there is deleted and reported so."""
        for step in catalog.steps:
            for tier in step.committed:
                gen.committed.setdefault(tier, set()).add(step.step)
        for tier, steps in gen.committed.items():
            for old in sorted(steps)[: -gen.keep.get(tier, 2)]:
                if (tier, old) in gen.deleted:
                    continue
                gen.deleted.add((tier, old))
                for rank in gen.ranks:
                    self.landings.put(
                        wire.CkptLanding(
                            node=self.node,
                            job=gen.job,
                            step=old,
                            rank=rank,
                            tier=tier,  # type: ignore[arg-type]
                            event="deleted",
                            generation=gen.generation,
                            at=now,
                        )
                    )

    async def _run_command(self, cmd: wire.Command) -> None:
        ack = await self.ledger.handle(cmd)
        with contextlib.suppress(Exception):
            await self.link.publish(wire.ack_topic(self.node), wire.encode(ack))

    async def _execute(self, cmd: wire.Command) -> dict[str, Any]:
        args = cmd.args
        match args:
            case wire.StartRanksArgs():
                return self._start(args)
            case wire.StopRanksArgs():
                return self._stop(args)
            case wire.AllocPortArgs():
                return {"port": 29500}
            case wire.BurnInArgs():
                drain = self.health.status is wire.HealthStatus.DRAIN
                return {"passed": not drain, "reasons": [], "checks": ["sim"]}
            case wire.PingArgs():
                return {"pong": time.time()}
            case wire.ResampleArgs():
                await self.heartbeat()
                return {"status": self.health.status.value}
            case wire.RebirthArgs():
                await self.link.publish(
                    wire.birth_topic(self.node), wire.encode(self.birth()), retain=True
                )
                return {"seq": self.seq}
            case wire.SaveNowArgs():
                return {"ranks": []}
            case wire.PrewarmArgs():  # a simulated spare has no interpreters to keep
                return {"warm": len(args.start.ranks)}
            case wire.ProbeLinkArgs():  # no bytes move: the figure of a healthy 100 Gb/s link
                seconds = args.nbytes / LINK_MB_S / 1e6
                figure = {"mb_s": LINK_MB_S, "nbytes": args.nbytes, "seconds": round(seconds, 4)}
                await asyncio.sleep(2 * seconds if args.both_ways else seconds)
                return {
                    **figure,
                    "peer": args.peer.node,
                    **({"back": figure} if args.both_ways else {}),
                }
        raise AssertionError(f"unhandled command {args!r}")

    def _start(self, args: wire.StartRanksArgs) -> dict[str, Any]:
        now = time.time()
        old = self.gens.get(args.job)
        if old is not None and old.generation == args.generation:
            return {"pids": [], "already_started": True}
        if old is not None and old.generation < args.generation:
            # As the agent does: an older generation whose stop never came goes first.
            self._exited(old, now, old.last_step, signal=15)
        plan = args.ckpt
        interval = plan.interval if plan is not None else "auto"
        gen = Gen(
            job=args.job,
            generation=args.generation,
            ranks=[s.rank for s in args.ranks],
            tiers=list(plan.tiers) if plan is not None else ["ram"],
            buddy=plan.buddy.node if plan is not None and plan.buddy is not None else None,
            interval_s=float(interval) if isinstance(interval, float | int) else 60.0,
            keep=dict(plan.keep) if plan is not None else {},
            steps=sim_steps(args.command),
            restoring_since=now,
        )
        self.gens[args.job] = gen
        emit(ev="start", node=self.node, job=args.job, gen=args.generation, at=now)
        catalog = self.catalogs.get(args.job)
        if catalog is not None and catalog.generation >= args.generation:
            self._restored(gen, catalog, now)
        return {"pids": [100000 + r for r in gen.ranks]}

    def _restored(self, gen: Gen, catalog: wire.CkptCatalog, now: float) -> None:
        """The ranks of ``gen`` learnt their restore step from ``catalog`` (of their
        generation): they report it, and step from the next tick."""
        took = now - (gen.restoring_since or now)
        gen.restoring_since = None
        gen.restore_step = catalog.restore_step
        for rank in gen.ranks:
            self.rank_events.put(
                wire.RankEvent(
                    node=self.node,
                    job=gen.job,
                    generation=gen.generation,
                    rank=rank,
                    event="restored",
                    step=gen.restore_step,
                    took_s=round(max(took, 0.05), 3),
                    at=now,
                )
            )

    def _stop(self, args: wire.StopRanksArgs) -> dict[str, Any]:
        now = time.time()
        gen = self.gens.get(args.job)
        emit(ev="stop", node=self.node, job=args.job, gen=args.generation, at=now)
        if gen is None or gen.generation > args.generation:
            return {"stopped": []}
        del self.gens[args.job]
        self._exited(gen, now, gen.last_step, signal=15)
        return {"stopped": gen.ranks}

    def _exited(
        self,
        gen: Gen,
        now: float,
        step: int | None,
        *,
        code: int | None = None,
        signal: int | None = None,
    ) -> None:
        """Each rank of ``gen`` reports its exit (stopped: ``signal``; done: ``code``)."""
        for rank in gen.ranks:
            self.rank_events.put(
                wire.RankEvent(
                    node=self.node,
                    job=gen.job,
                    generation=gen.generation,
                    rank=rank,
                    event="exited",
                    code=code,
                    signal=signal,
                    pid=100000 + rank,
                    step=step,
                    at=now,
                )
            )

    # --- the ranks --------------------------------------------------------------

    def step(self, step: int, now: float) -> None:
        """Every rank of every generation here reports ``step``; a due one is saved; a
        job's ranks that took their ``--steps`` exit 0."""
        finished, failed = [], []
        for gen in list(self.gens.values()):
            if gen.restoring_since is not None:
                if now - gen.restoring_since > CATALOG_WAIT_S:
                    older = self.catalogs.get(gen.job)
                    if older is not None:
                        self.sim.catalog_waits["late"] += 1
                        self._restored(gen, older, now)
                    else:
                        self.sim.catalog_waits["none"] += 1
                        failed.append(gen)  # the ranks cannot tell what to restore
                continue
            for rank in gen.ranks:
                self.metrics.add(
                    StepReport(
                        job=gen.job,
                        generation=gen.generation,
                        rank=rank,
                        pid=100000 + rank,
                        step=step,
                        at=now,
                        scalars={"loss": 2.0 + 1.0 / (1 + step), "tokens": 8192.0},
                    )
                )
            if not gen.stepped:
                gen.stepped = True
                for rank in gen.ranks:
                    self.rank_events.put(
                        wire.RankEvent(
                            node=self.node,
                            job=gen.job,
                            generation=gen.generation,
                            rank=rank,
                            event="stepped",
                            step=step,
                            at=now,
                        )
                    )
            gen.last_step = step
            every = max(1, round(gen.interval_s / self.sim.step_s))
            if step % every == 0 and step not in gen.saved:
                gen.saved.add(step)
                self.spawn(self._save(gen, step))
            if gen.first_step is None:
                gen.first_step = step
            if gen.steps is not None and step - gen.first_step + 1 >= gen.steps:
                finished.append(gen)
        for gen in finished:
            del self.gens[gen.job]
            self._exited(gen, now, step, code=0)
        for gen in failed:
            del self.gens[gen.job]
            self._exited(gen, now, None, code=1)

    async def _save(self, gen: Gen, step: int) -> None:
        """The ranks' shards of ``step`` land at every tier of the plan, in its order."""
        waited = 0.0
        for tier in gen.tiers:
            delay = TIER_DELAY_S.get(tier, 0.0) - waited
            if delay > 0:
                await asyncio.sleep(delay)
                waited += delay
            if self.dead or self.gens.get(gen.job) is not gen:
                return
            now = time.time()
            for rank in gen.ranks:
                self.landings.put(
                    wire.CkptLanding(
                        node=self.node,
                        job=gen.job,
                        step=step,
                        rank=rank,
                        tier=tier,  # type: ignore[arg-type]
                        nbytes=SHARD_BYTES,
                        checksum=f"{step:x}{rank:x}{gen.generation:x}".rjust(16, "0"),
                        holder=gen.buddy if tier == "peer" else None,
                        generation=gen.generation,
                        at=now,
                    )
                )

    # --- faults -----------------------------------------------------------------

    async def ecc(self) -> None:
        """An uncorrected ECC error on GPU 0: the classifier says drain, and the agent
        sends a heartbeat at once (health changed)."""
        gpus = tuple(
            GpuSample(index=i, uuid=f"GPU-{self.node}-{i}", ecc_dbe_volatile=1 if i == 0 else 0)
            for i in range(self.sim.gpus)
        )
        self.health = self.classifier.classify(NodeSample(gpus=gpus), None, time.time())
        await self.heartbeat()

    def hang(self, job: str) -> None:
        gen = self.gens.get(job)
        if gen is None:
            return
        self.rank_events.put(
            wire.RankEvent(
                node=self.node,
                job=job,
                generation=gen.generation,
                rank=gen.ranks[0],
                event="hung",
                step=gen.last_step,
                idle_s=30.0,
                detail="fleet_sim: the furthest behind",
                at=time.time(),
            )
        )


def sim_steps(command: list[str]) -> int | None:
    """The steps a simulated job's ranks take before they exit 0 (``["sim", "--steps",
    "N"]``); None: until stopped."""
    if len(command) >= 3 and command[1] == "--steps" and command[2].isdigit():
        return int(command[2])
    return None


class Sim:
    def __init__(self, args: argparse.Namespace) -> None:
        self.settings = MqttSettings(
            port=args.port, keepalive_s=args.keepalive, reconnect_max_s=2.0
        )
        self.gpus = args.gpus
        self.heartbeat_s = args.heartbeat
        self.pack = None if args.one_landing_a_message else wire.pack_landings
        self.pack_ranks = None if args.one_landing_a_message else wire.pack_rank_events
        self.step_s = args.step
        self.started_at = time.time()
        self.sent: dict[str, int] = {"rank": 0, "ckpt": 0, "metrics": 0}
        # Nodes whose ranks waited CATALOG_WAIT_S for their generation's catalog: restored
        # from an older one (late), or failed for want of any (none).
        self.catalog_waits = {"late": 0, "none": 0}
        self.watch: LoopWatch | None = None
        self.quiet = False  # metrics stopped (``quiet``), for the final count
        self.last_landing: dict[tuple[str, int], float] = {}
        # (job, step) -> when each node first saw it committed at every tier
        self.catalogs: dict[tuple[str, int], list[float]] = {}
        self.ok_health = wire.Health(
            status=wire.HealthStatus.OK,
            gpus=[
                wire.GpuGauges(
                    index=i,
                    temperature_c=45.0,
                    power_w=300.0,
                    util_pct=97.0,
                    mem_used_bytes=60 * 2**30,
                    mem_total_bytes=80 * 2**30,
                    ecc_sbe_volatile=0,
                    ecc_dbe_volatile=0,
                    retired_pages=0,
                )
                for i in range(self.gpus)
            ],
            host=wire.HostGauges(
                disk_free_bytes=2**40,
                disk_total_bytes=2**41,
                mem_available_bytes=2**40,
                mem_total_bytes=2**41,
                load1=12.0,
                cpu_count=128,
            ),
            sampled_at=time.time(),
        )
        self.agents = {
            f"n{i:05d}": SimAgent(self, f"n{i:05d}", f"rack{i // args.rack_size:03d}")
            for i in range(args.first, args.first + args.count)
        }

    def gpu_descriptors(self, node: str) -> list[wire.GpuDescriptor]:
        return [
            wire.GpuDescriptor(
                index=i, uuid=f"GPU-{node}-{i}", model="H100", memory_bytes=80 * 2**30
            )
            for i in range(self.gpus)
        ]

    async def run(self) -> None:
        # This process's own stalls: its nodes' heartbeats wait behind them too (a real
        # agent's loop serves one node, this one serves --count).
        async with LoopWatch(own=("bench", "phalanx", "agentd"), keep=256) as self.watch:
            for agent in self.agents.values():
                await agent.start()
                await asyncio.sleep(0.002)  # a fleet does not connect in one instant
            ticker = asyncio.create_task(self._tick())
            try:
                await self._orders()
            finally:
                ticker.cancel()

    async def _tick(self) -> None:
        while True:
            now = time.time()
            step = int(now // self.step_s)
            await asyncio.sleep((step + 1) * self.step_s - now)
            now = time.time()
            for agent in self.agents.values():
                if not agent.dead:
                    agent.step(step + 1, now)

    async def _orders(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            order = json.loads(line)
            op, agent = order["op"], self.agents.get(order.get("node", ""))
            if op == "die" and agent is not None:
                emit(ev="died", node=agent.node, at=time.time())
                agent.die()
            elif op == "ecc" and agent is not None:
                at = time.time()
                await agent.ecc()
                emit(ev="ecc", node=agent.node, at=at)
            elif op == "hang" and agent is not None:
                emit(ev="hang", node=agent.node, at=time.time())
                agent.hang(order["job"])
            elif op == "report":
                emit(ev="report", **self.report())
            elif op == "quiet":  # no more metrics batches: the run is being counted
                self.quiet = True
            elif op == "quit":
                return

    def report(self) -> dict[str, Any]:
        live = [a for a in self.agents.values() if not a.dead]
        return {
            "sent": self.sent,
            "catalog_waits": self.catalog_waits,
            "queued": sum(len(a.rank_events) + len(a.landings) + len(a.metrics_out) for a in live),
            "connected": sum(a.link.connected for a in live),
            "stuck": [
                [
                    a.node,
                    len(a.rank_events),
                    len(a.landings),
                    len(a.metrics_out),
                    a.link.connected,
                    a.supervisor_known.is_set(),
                ]
                for a in live
                if len(a.rank_events) + len(a.landings) + len(a.metrics_out)
            ][:20],
            "last_landing": [[j, s, t] for (j, s), t in self.last_landing.items()],
            "catalogs": [[j, s, v] for (j, s), v in self.catalogs.items()],
            "loop": self.watch.view(recent=256) if self.watch is not None else None,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--count", type=int, default=256)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rack-size", type=int, default=32)
    ap.add_argument("--heartbeat", type=float, default=5.0)
    ap.add_argument("--keepalive", type=int, default=30)
    ap.add_argument("--step", type=float, default=2.0, help="seconds per training step")
    ap.add_argument(
        "--one-landing-a-message",
        action="store_true",
        help="do not pack landings or rank events (CkptLandings, RankEvents)",
    )
    args = ap.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(Sim(args).run())
    sys.stdout.flush()
    os._exit(0)  # the links close with the process (quick, and no DISCONNECT to wait for)


if __name__ == "__main__":
    main()
