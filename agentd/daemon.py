"""The node agent: health sampling, heartbeats, commands and the HTTP server.

:class:`Agent` is an async context manager owning one task group of named loops, and
one owner (:class:`~phalanx.tasks.Tasks`) of its one-off tasks: the commands being run
and the checkpoint catalogs being applied.

Shutdown, in this order, within one deadline (``stop_grace_s`` + ``SHUTDOWN_MARGIN_S``,
inside the unit's ``TimeoutStopSec``):

1. stop accepting: no new command or catalog is started (the ranks' sockets stay open:
   a rank saving in its SIGTERM grace still needs them);
2. wait for the commands and catalogs in flight (at most ``COMMAND_DRAIN_S``), so a
   start in flight cannot leave ranks behind the stop; cancel the rest, with a message;
3. stop the ranks (SIGTERM, ``stop_grace_s``, SIGKILL), their exits reported;
4. close the checkpoint service: write-downs in flight finish and report their
   landings;
5. drain: the rank events, then the checkpoint landings, are sent to the broker, and
   the ranks' last metrics window;
6. publish the ``shutdown`` death, so the supervisor does not wait for the keepalive;
7. cancel the loops; close the link, the sockets and the HTTP server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
import socket
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from agentd.burnin import burn_in
from agentd.ckpt import CkptService, start_rank_socket
from agentd.commands import CommandLedger
from agentd.config import AgentSettings
from agentd.gpu.base import GpuBackend, GpuInfo, NodeSample
from agentd.gpu.sim import SimBackend
from agentd.health import HealthClassifier
from agentd.host import interface_of, sample_host
from agentd.http import start_http
from agentd.linkprobe import ProbeFailed, probe
from agentd.metrics import MetricsWindow
from agentd.progress import ProgressMonitor, socket_beside
from agentd.ranks import RankRunner
from ckpt import Pacing
from phalanx import __version__, wire
from phalanx.link import LinkDown, MqttLink, Outbox, Will
from phalanx.tasks import Deadline, Tasks, supervised

log = logging.getLogger(__name__)

# The agent's own shutdown after its ranks' grace: commands, checkpoint write-downs, the
# broker. With stop_grace_s (30 s) it stays inside the unit's TimeoutStopSec (90 s).
SHUTDOWN_MARGIN_S = 50.0
# How long commands and catalogs in flight get to finish at shutdown.
COMMAND_DRAIN_S = 10.0
# Metrics batches waiting for the broker at most (one per job every metrics_interval_s:
# minutes of one job's); past it the oldest is dropped and counted.
METRICS_QUEUED = 64
METRICS_FLUSH_S = 2.0  # at shutdown: a chart's last points are not worth a longer stop


class BirthSequence:
    """A persisted, growing counter: every (re)connect is a newer birth, even across a lost
    data directory (it never falls below the wall clock in milliseconds)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.value = int(path.read_text().strip())
        except (OSError, ValueError):
            self.value = 0

    def next(self) -> int:
        # Milliseconds since the epoch when they are larger: a node whose data dir was lost
        # (a reimage) still announces a birth newer than the one the supervisor remembers.
        self.value = max(self.value + 1, int(time.time() * 1000))
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{self.value}\n")
        os.replace(tmp, self.path)
        return self.value


def _health_key(h: wire.Health) -> tuple[object, ...]:
    return (h.status, tuple(sorted((r.code, r.gpu or -1, r.severity) for r in h.reasons)))


class Agent:
    def __init__(self, settings: AgentSettings, backend: GpuBackend) -> None:
        self.settings = settings
        self.node = settings.node_id
        self.backend = backend
        self.started_at = time.time()
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        (settings.data_dir / "state").mkdir(exist_ok=True)
        self._seq = BirthSequence(settings.data_dir / "state" / "birth_seq")
        self._birth_seq = self._seq.value
        self.inventory: list[GpuInfo] = backend.inventory()
        self.classifier = HealthClassifier(settings.thresholds, len(self.inventory))
        self.health = wire.Health(status=wire.HealthStatus.OK)
        self.sample: NodeSample | None = None
        self._beats = 0
        self._sampler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpu-sample")
        self._pending_sample: concurrent.futures.Future[NodeSample] | None = None
        self.ledger = CommandLedger(self.node, self._execute)
        self.socket_path = settings.socket_path()
        # The ranks' training channel (phalanx.rank.step): their progress, hang detection.
        progress_socket = socket_beside(self.socket_path)
        self.ranks = RankRunner(
            self.node,
            settings.data_dir,
            self.socket_path,
            self._on_rank_event,
            gpus=[g.index for g in self.inventory],
            not_on_cpus=set(settings.ckpt.write_cpus),
            progress_socket=progress_socket,
            last_step=self._last_step,
            socket_ifname=interface_of(settings.advertised_address()),
            pass_env=settings.ranks.pass_env,
        )
        # Training metrics: step reports folded into one batch per job and interval.
        self.metrics = MetricsWindow(self.node)
        self.metrics_sent = 0  # batches handed to the metrics outbox
        self._names_logged = -math.inf
        self.progress = ProgressMonitor(
            self.node,
            progress_socket,
            settings.data_dir,
            self._on_rank_event,
            self.ranks.pids,
            on_step=self.metrics.add,
        )
        self.ranks.parking = self.progress  # in-process restarts: ranks parked, resumed
        self._loop: asyncio.AbstractEventLoop | None = None
        # This node's own HTTP token (its rank logs and peer tier; phalanx.agent_tokens),
        # read once; unreadable or unset, the token routes answer 403.
        self.http_token = ""
        if settings.http.token_file is not None:
            try:
                self.http_token = settings.http.token_file.read_text().strip()
            except OSError as exc:
                log.error(
                    "cannot read http.token_file %s: %s; token routes answer 403",
                    settings.http.token_file,
                    exc,
                )
        self.ckpt = CkptService(
            self.node,
            settings.data_dir,
            settings.ckpt.shm_dir,
            settings.ckpt.object_store,
            self._publish_landing,
            pacing=Pacing(
                nice=settings.ckpt.write_nice,
                compress_level=settings.ckpt.compress_level,
                compress_min_saving=settings.ckpt.compress_min_saving,
                cpus=tuple(settings.ckpt.write_cpus),
            ),
            peer_ssl=settings.http.peer_ssl(),  # HTTPS to buddies when this agent serves it
            catalog_wait_s=settings.ckpt.catalog_wait_s,
        )
        self.link = MqttLink(
            settings.mqtt.resolved(),
            f"agentd-{self.node}",
            subscriptions=wire.agent_subscriptions(self.node),
            handler=self._on_message,
            will=self._will,
            on_connect=self._on_connect,
            persistent_session=True,
        )
        # Set once this connection has seen the supervisor's retained status, online or
        # offline: either way the broker holds the supervisor's session and queues for it.
        # Without one the broker is fresh (it restarted and lost its sessions): what is
        # sent before the supervisor subscribes again would be delivered to nobody.
        self.supervisor_known = asyncio.Event()
        gate = self.supervisor_known
        # The newest leadership term seen from a supervisor (wire.Command.term): a command
        # or catalog of an older term comes from a supervisor that has been replaced
        # (paused while a standby took over) and is refused.
        self.term = 0
        self.refused_stale = 0
        self._supervisor_here = False  # its status online seen on this connection
        self.rank_events = Outbox(
            self.link,
            wire.rank_topic(self.node),
            "rank event",
            gate=gate,
            pack=wire.pack_rank_events,  # what queued up goes in one message
            max_queued=settings.outbox_max,
        )
        self.landings = Outbox(
            self.link,
            wire.ckpt_topic(self.node),
            "checkpoint landing",
            gate=gate,
            pack=wire.pack_landings,  # what queued up goes in one message
            max_queued=settings.outbox_max,
        )
        # The window's batches, QoS 1 like the rest: a sweep's pruner and a job's last value
        # read them. Sent again when a connection drops with one on its way.
        self.metrics_out = Outbox(
            self.link,
            wire.metrics_topic(self.node),
            "metrics batch",
            gate=gate,
            max_queued=METRICS_QUEUED,
        )
        self.http_port = 0
        self._group: asyncio.TaskGroup | None = None
        self._tasks = Tasks(f"agent {self.node}")  # commands and catalogs being handled
        self._loops: list[asyncio.Task[None]] = []
        self._stack = contextlib.AsyncExitStack()
        self.ready = asyncio.Event()

    # --- lifecycle -----------------------------------------------------------

    async def __aenter__(self) -> Agent:
        await self._stack.__aenter__()
        self._loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self.ranks.reap_orphans)
            await self.sample_health()
            self.http_port = await self._stack.enter_async_context(start_http(self))
            await self._stack.enter_async_context(start_rank_socket(self, self.socket_path))
            await self._stack.enter_async_context(self.progress)
            await self._stack.enter_async_context(self.link)
            self._group = await self._stack.enter_async_context(asyncio.TaskGroup())
            for name, loop in (
                ("sample", self._sample_loop),
                ("heartbeat", self._heartbeat_loop),
                ("metrics", self._metrics_loop),
                ("rank-events", self.rank_events.run),
                ("ckpt-landings", self.landings.run),
                ("metrics-out", self.metrics_out.run),
            ):
                self._loops.append(self._group.create_task(supervised(name, loop), name=name))
        except BaseException:
            await self._stack.__aexit__(None, None, None)
            raise
        self.ready.set()
        log.info(
            "agent %s up: %d GPUs (%s), http port %d",
            self.node,
            len(self.inventory),
            self.backend.name,
            self.http_port,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        deadline = Deadline(self.settings.stop_grace_s + SHUTDOWN_MARGIN_S)
        self._tasks.close()
        await self._tasks.shutdown(timeout=min(COMMAND_DRAIN_S, deadline.left()))
        await self.ranks.stop_all(self.settings.stop_grace_s)
        await self.ckpt.close(timeout=deadline.left(floor=1.0))
        await asyncio.sleep(0)  # the landings the close queued from its threads
        await self.rank_events.flush(timeout=deadline.left(floor=1.0))
        await self.landings.flush(timeout=deadline.left(floor=1.0))
        self.queue_metrics()  # the ranks' last window
        await self.metrics_out.flush(timeout=min(METRICS_FLUSH_S, deadline.left(floor=1.0)))
        if self.link.connected:
            death = wire.NodeDeath(node=self.node, seq=self._birth_seq, cause="shutdown")
            with contextlib.suppress(LinkDown):
                await self.link.publish(
                    wire.death_topic(self.node),
                    wire.encode(death),
                    retain=True,
                    timeout=deadline.left(floor=1.0),
                )
        for task in self._loops:
            task.cancel()
        await self._stack.__aexit__(exc_type, exc, tb)
        self._sampler.shutdown(wait=False, cancel_futures=True)
        self.backend.close()
        log.info("agent %s stopped", self.node)

    # --- MQTT --------------------------------------------------------------------

    def _will(self) -> Will:
        # A new connection is a new birth: the will must name the seq the birth will carry.
        self._birth_seq = self._seq.next()
        death = wire.NodeDeath(node=self.node, seq=self._birth_seq, cause="lost")
        return Will(wire.death_topic(self.node), wire.encode(death), retain=True)

    def birth(self) -> wire.NodeBirth:
        s = self.settings
        return wire.NodeBirth(
            node=self.node,
            seq=self._birth_seq,
            hostname=socket.gethostname(),
            address=s.advertised_address(),
            http_port=self.http_port,
            gpus=[
                wire.GpuDescriptor(
                    index=g.index, uuid=g.uuid, model=g.model, memory_bytes=g.memory_bytes
                )
                for g in self.inventory
            ],
            gpu_backend=self.backend.name,
            topology=wire.Topology(rack=s.rack, nvlink_domain=s.nvlink_domain),
            version=__version__,
            started_at=self.started_at,
            health=self.health,
            features=[wire.FEATURE_PROBE_BOTH_WAYS],
        )

    async def _on_connect(self) -> None:
        # A new connection: the supervisor's retained status, delivered once this returns,
        # says again whether the broker knows the supervisor (a restarted one may not).
        self.supervisor_known.clear()
        self._supervisor_here = False
        await self.link.publish(wire.birth_topic(self.node), wire.encode(self.birth()), retain=True)
        log.info("published birth seq %d", self._birth_seq)
        await self.publish_heartbeat()

    async def publish_heartbeat(self) -> None:
        beat = wire.Heartbeat(
            node=self.node,
            seq=self._birth_seq,
            n=self._beats,
            sent_at=time.time(),
            health=self.health,
            jobs=self.ranks.running(),
            port=self.ranks.free_port(),
        )
        self._beats += 1
        await self.link.publish(wire.heartbeat_topic(self.node), wire.encode(beat), qos=0)

    async def _on_message(self, topic: str, payload: bytes) -> None:
        try:
            inbound = wire.parse(topic, payload)
        except wire.WireError as exc:
            log.warning("dropped: %s", exc)
            return
        message = inbound.message
        if isinstance(message, wire.SupervisorStatus):
            # Any status, of any term: the broker holds the supervisor's session.
            self.supervisor_known.set()
        if isinstance(message, wire.Command | wire.CkptCatalog | wire.SupervisorStatus):
            # Term 0 is a supervisor alone (no election): always taken, so that a fleet
            # moved back to one supervisor on SQLite is not refused by its agents.
            if 0 < message.term < self.term:
                self.refused_stale += 1
                log.warning(
                    "refused a %s of leadership term %d: term %d leads now (a supervisor "
                    "that was replaced is still sending)",
                    message.kind,
                    message.term,
                    self.term,
                )
                if isinstance(message, wire.Command):
                    self._tasks.spawn(self._refuse_stale(message), name=f"refuse-{message.id}")
                return
            if message.term > self.term:
                log.info("supervisor leadership term %d (was %d)", message.term, self.term)
                self.term = message.term
        if isinstance(inbound.message, wire.CkptCatalog):
            self._tasks.spawn(
                self.ckpt.on_catalog(inbound.message), name=f"ckpt-catalog-{inbound.message.job}"
            )
            return
        if isinstance(inbound.message, wire.SupervisorStatus):
            self._follow_supervisor(inbound.message)
            return
        if inbound.message is None:
            return  # a cleared retained catalog
        if not isinstance(inbound.message, wire.Command):
            log.warning("dropped: unexpected %s on %s", type(inbound.message).__name__, topic)
            return
        # Run commands beside the message loop, so a slow one does not hold up the next.
        cmd = inbound.message
        self._tasks.spawn(self._run_command(cmd), name=f"command-{cmd.args.op}-{cmd.id}")

    def _follow_supervisor(self, status: wire.SupervisorStatus) -> None:
        """With several brokers listed: the supervisor seen online on this connection and
        now offline here (its will, or its clean stop) has lost this broker, or stopped:
        go on to the next broker, where it may still be (it is on all it reaches). A
        status offline already at connect (retained) moves nothing: with no supervisor
        anywhere, the agent stays where it is."""
        if status.online:
            self._supervisor_here = True
        elif self._supervisor_here:
            self._supervisor_here = False
            self.link.move_on("the supervisor went offline on this broker")

    async def _refuse_stale(self, cmd: wire.Command) -> None:
        ack = wire.CommandAck(
            id=cmd.id,
            node=self.node,
            status=wire.AckStatus.FAILED,
            detail=f"refused: leadership term {cmd.term} is older than term {self.term}, "
            "which leads now; not executed",
            acked_at=time.time(),
        )
        try:
            await self.link.publish(wire.ack_topic(self.node), wire.encode(ack))
        except LinkDown as exc:
            log.warning("could not ack command %s: %s", cmd.id, exc)

    async def _run_command(self, cmd: wire.Command) -> None:
        ack = await self.ledger.handle(cmd)
        try:
            await self.link.publish(wire.ack_topic(self.node), wire.encode(ack))
        except LinkDown as exc:
            log.warning("could not ack command %s: %s", cmd.id, exc)

    async def _execute(self, cmd: wire.Command) -> dict[str, Any]:
        match cmd.args:
            case wire.PingArgs():
                return {"pong": time.time()}
            case wire.ResampleArgs():
                await self.sample_health()
                await self.publish_heartbeat()
                return {"status": self.health.status.value}
            case wire.StartRanksArgs():
                if cmd.args.generation >= self.ckpt.generations.get(cmd.args.job, 0):
                    self.ckpt.configure(cmd.args.job, cmd.args.generation, cmd.args.ckpt)
                # Before the ranks start: their first reports find the generation known.
                self.progress.begin(cmd.args.job, cmd.args.generation, cmd.args.hang_timeout_s)
                return await self.ranks.start(cmd.args)
            case wire.StopRanksArgs():
                self.progress.end(cmd.args.job, cmd.args.generation)
                return await self.ranks.stop(
                    cmd.args.job,
                    cmd.args.generation,
                    grace_s=cmd.args.grace_s,
                    keep_warm=cmd.args.keep_warm,
                )
            case wire.PrewarmArgs():
                return await self.ranks.prewarm(cmd.args)
            case wire.BurnInArgs():
                await self.sample_health()
                corrupt, perf = frozenset[int](), None
                if isinstance(self.backend, SimBackend):
                    corrupt = await asyncio.to_thread(self.backend.corrupt)
                    perf = await asyncio.to_thread(self.backend.perf)
                result = await burn_in(
                    self.backend.name,
                    self.health,
                    [g.index for g in self.inventory],
                    corrupt=corrupt,
                    sim_perf=perf,
                )
                log.info(
                    "burn-in %s: %s",
                    "passed" if result.passed else "failed",
                    "; ".join(result.reasons) or "-",
                    extra={"node": self.node, "event": "burn_in"},
                )
                return result.as_result()
            case wire.ProbeLinkArgs():
                # ``max_s`` is each way's: both ways share what is left of the deadline.
                ways = 2 if cmd.args.both_ways else 1
                left = cmd.deadline - time.time() - 1.0
                try:
                    found = await probe(
                        self.node,
                        cmd.args.peer,
                        cmd.args.nbytes,
                        min(cmd.args.max_s, max(0.1, left / ways)),
                        self.settings.http.peer_ssl(),
                        both_ways=cmd.args.both_ways,
                    )
                except ProbeFailed as exc:
                    log.warning("link probe: %s", exc)
                    return {"error": str(exc), "reached": exc.reached}
                if "back_error" in found:
                    log.warning("link probe, the way back: %s", found["back_error"])
                return found
            case wire.SaveNowArgs():
                job, generation = cmd.args.job, cmd.args.generation
                here = sorted(self.ranks.pids(job, generation))
                asked = self.progress.request_save(job, generation, here)
                # The step each asked rank reported last: the save comes after its next
                # report, so the supervisor takes no commit at or before step + 1 (a
                # checkpoint in flight when it asked, docs/jobspec.md) for this save.
                steps = {
                    str(r): s
                    for r in asked
                    if (s := self.progress.last_step(job, generation, r)) is not None
                }
                return {"ranks": asked, "steps": steps}
            case wire.AllocPortArgs():
                return {"port": self.ranks.free_port()}
            case wire.RebirthArgs():
                await self.link.publish(
                    wire.birth_topic(self.node), wire.encode(self.birth()), retain=True
                )
                return {"seq": self._birth_seq}
        raise AssertionError(f"unhandled command {cmd.args!r}")  # pragma: no cover

    # --- checkpoints ----------------------------------------------------------------

    async def _on_rank_event(self, event: wire.RankEvent) -> None:
        if event.event == "exited":
            self.ckpt.rank_exited(event.job, event.rank)
            self.progress.rank_exited(event.job, event.generation, event.rank)
        self.rank_events.put(event)

    def _last_step(self, job: str, generation: int, rank: int) -> int | None:
        return self.progress.last_step(job, generation, rank)

    def _publish_landing(self, msg: wire.CkptLanding | wire.CkptReleased) -> None:
        """From the engines' threads (or the loop): queue a report for the MQTT loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.landings.put, msg)

    # --- loops ---------------------------------------------------------------

    async def sample_health(self) -> bool:
        """Sample GPUs and host once; True when the health changed."""
        timeout = self.settings.gpu.call_timeout_s
        sample: NodeSample | None = None
        error: str | None = None
        if self._pending_sample is not None and not self._pending_sample.done():
            error = f"NVML sample timed out: the call has hung for over {timeout:.0f}s"
        else:
            self._pending_sample = self._sampler.submit(self.backend.sample)
            try:
                sample = await asyncio.wait_for(asyncio.wrap_future(self._pending_sample), timeout)
            except TimeoutError:
                error = f"NVML sample timed out after {timeout:.0f}s"
            except Exception as exc:
                error = f"{self.backend.name} sample failed: {exc}"
        if error:
            log.error("%s", error)
        try:
            host = await asyncio.to_thread(sample_host, self.settings.data_dir)
        except OSError as exc:
            log.error("host sample failed: %s", exc)
            host = None
        previous = self.health
        self.sample = sample
        self.health = self.classifier.classify(sample, host, time.time(), backend_error=error)
        changed = _health_key(previous) != _health_key(self.health)
        if changed:
            log.warning(
                "health %s -> %s: %s",
                previous.status.value,
                self.health.status.value,
                ", ".join(f"{r.code}(gpu {r.gpu})" for r in self.health.reasons) or "-",
                extra={"node": self.node, "event": "health_change"},
            )
        return changed

    async def _sample_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.gpu.sample_interval_s)
            if await self.sample_health() and self.link.connected:
                with contextlib.suppress(LinkDown):
                    await self.publish_heartbeat()

    async def _metrics_loop(self) -> None:
        """Every ``metrics_interval_s``: the window's batches into the metrics outbox (QoS 1,
        in order, sent again after a connection lost with one on its way; the broker keeps
        them for the supervisor's session while it is away). While the link is down, or the
        broker it is on has not shown the supervisor's session yet (``supervisor_known``),
        the window is not flushed: it goes on folding the ranks' reports, and is sent,
        longer, after."""
        while True:
            await asyncio.sleep(self.settings.metrics_interval_s)
            self.queue_metrics()

    @property
    def metrics_dropped(self) -> int:
        """Batches pushed out of a full metrics outbox (``METRICS_QUEUED``)."""
        return self.metrics_out.dropped

    def queue_metrics(self) -> None:
        if not self.link.connected or not self.supervisor_known.is_set():
            return  # kept in the window until a broker that holds the supervisor's session
        for batch in self.metrics.flush(time.time()):
            if batch.dropped_names and time.monotonic() - self._names_logged >= 60.0:
                self._names_logged = time.monotonic()
                log.warning(
                    "job %s: %d scalar values left out of this window's metrics: its ranks "
                    "report more than %d names (phalanx.rank.step)",
                    batch.job,
                    batch.dropped_names,
                    wire.MAX_METRIC_NAMES,
                    extra={"job": batch.job, "event": "metrics_names_dropped"},
                )
            self.metrics_out.put(batch)
            self.metrics_sent += 1

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            if not self.link.connected:
                continue
            try:
                await self.publish_heartbeat()
            except LinkDown as exc:
                log.warning("heartbeat not sent: %s", exc)
