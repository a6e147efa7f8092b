"""The supervisor daemon: MQTT in, registry, commands out, REST API for operators."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType

from ckpt.stores import open_store
from phalanx import wire
from phalanx.agent_tokens import AgentKeys, read_secret
from phalanx.link import LinkDown, MqttLinks, Will
from phalanx.loopwatch import LoopWatch
from phalanx.settings import ConfigError
from phalanx.tasks import Deadline, supervised
from supervisor.api.app import start_api
from supervisor.backup import StoreBackups
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.publisher import CatalogPublisher
from supervisor.config import SupervisorSettings
from supervisor.control.controller import JobController
from supervisor.errors import StoreError
from supervisor.fleet.commands import Commands
from supervisor.fleet.registry import Registry
from supervisor.leadership import Leadership
from supervisor.store import Store
from supervisor.sweeps import Sweeps
from supervisor.telemetry.slow_nodes import SlowNode
from supervisor.telemetry.training import TrainingMetrics
from supervisor.telemetry.wire_stats import WireStats

log = logging.getLogger(__name__)


# Last wills that arrive this long before the supervisor loses the broker itself were
# most likely sent by a broker going down, not by dying nodes.
WILL_SUSPECT_S = 5.0
# A node offline is a failure of its jobs once it has been offline this long with the
# supervisor's own link up all along (a broker restart sends every node's will first).
OFFLINE_CONFIRM_S = 2.0
# A node offline with many others (Registry.mass_offline: a broker or network event
# more likely than that many failures) is confirmed only after a whole heartbeat
# timeout (``offline_after_s``) with the link up, time for it to reconnect.
# The whole shutdown's deadline (systemd's TimeoutStopSec is 30 s): what runs past it is
# cancelled, and a job's persisted state tells the next supervisor what to take up.
SHUTDOWN_S = 5.0
# The store's writes from the fleet (node events, a gang's rank exits) are written
# together this long after the first of them (or before any other write).
WRITE_SOON_S = 0.25


class Supervisor:
    """``leadership``: this supervisor's lead over standbys on the same PostgreSQL store
    (``supervisor.leadership``), taken before it is built; None: it is alone (SQLite)."""

    def __init__(
        self, settings: SupervisorSettings, token: str, *, leadership: Leadership | None = None
    ) -> None:
        self.settings = settings
        self.token = token
        self.leadership = leadership
        self.term = leadership.term if leadership is not None else 0
        # The fleet agent secret: every node's agent token and peer credential derive
        # from it (phalanx.agent_tokens); it stays on this host.
        self.agent_token = ""
        if settings.agent_token_file is not None:
            try:
                self.agent_token = read_secret(settings.agent_token_file)
            except ValueError as exc:
                raise ConfigError(f"agent_token_file: {exc}") from exc
        self.agent_keys = AgentKeys(self.agent_token)
        backup_dir = settings.backup_dir()
        self.store = Store(
            settings.state_dir / "state.db",
            backups=backup_dir,
            url=settings.store.url or None,
            pg_options=leadership.connection_options() if leadership else None,
            pg_session=leadership.session_settings() if leadership else (),
        )
        self.backups = (
            StoreBackups(
                self.store.path,
                backup_dir,
                interval_s=settings.store.backup_interval_s,
                keep=settings.store.backup_keep,
                remote=open_store(settings.store.backup_url) if settings.store.backup_url else None,
            )
            if backup_dir is not None
            else None
        )
        if leadership is not None:
            self.store.fence = leadership.fence
        self.store.defer(self._flush_soon)
        self.registry = Registry(self.store, offline_after_s=settings.offline_after_s)
        self.started_at = time.time()
        self.bad_messages = 0
        self.wire_stats = WireStats()  # messages taken by kind, heartbeat lag
        # The event loop's stalls, and where (GET /v1/stats, /metrics; issue 22).
        self.loopwatch = LoopWatch(name="the supervisor's event loop")
        # When the link to the broker last came up (None: down) and went down, on the
        # registry's clock: a node offline is acted on only once the link stayed up.
        self.link_since: float | None = None
        self.link_lost_at: float | None = None
        # On every broker listed at once (agents use one at a time): each node is heard
        # wherever it is, and its commands go to the broker its heartbeats come through.
        self.link = MqttLinks(
            settings.mqtt.resolved(),
            "phalanx-supervisor",
            subscriptions=wire.SUPERVISOR_SUBSCRIPTIONS,
            handler=self._on_link_message,
            route=self._route,
            will=lambda: Will(
                wire.SUPERVISOR_STATUS_TOPIC,
                wire.encode(wire.SupervisorStatus(online=False, since=time.time(), term=self.term)),
            ),
            on_connect=self._on_connect,
            # Rank events and landings sent while we restart, or while no supervisor
            # leads, are queued for us: the session is the supervisor's, whichever leads.
            persistent_session=True,
            before_connect=self._check_lead,
        )
        self._node_via: dict[str, int] = {}  # the link each node's heartbeats came through
        self._link_up = [False] * len(self.link.links)  # as the daemon last saw each link
        self.commands = Commands(
            self._publish,
            self.registry,
            timeout_s=settings.command_timeout_s,
            term=self.term,
            behind=lambda: self.link.behind_s,  # an ack may wait among what it has not read
        )
        self.catalog = CheckpointCatalog(self.store, term=self.term)
        self.publisher = CatalogPublisher(
            self.catalog,
            self._publish,
            job=lambda job_id: self.jobs.jobs.get(job_id),
            registry=self.registry,
            ram_linger_s=settings.ckpt_failed_ram_linger_s,
            agent_keys=self.agent_keys,
            publish_many=self._publish_many,
        )
        self.jobs = JobController(
            self.store,
            self.registry,
            settings,
            send=self.commands.send,
            publisher=self.publisher,
            offline_confirmed=self.offline_confirmed,
            agent_keys=self.agent_keys,
            write_now=self.link.write_now,
            written=self.link.written,
        )
        self.metrics = TrainingMetrics(
            self.store,
            self.jobs.jobs.get,
            interval_s=settings.metrics_interval_s,
            straggler_margin=settings.straggler_margin,
            straggler_windows=settings.straggler_windows,
            straggler_node_jobs=settings.straggler_node_jobs,
            on_slow_nodes=self._on_slow_nodes,
            gpu_model=self._gpu_model,
            gpu_peaks=settings.gpu_peak_flops,
        )
        # A trial's last windows: the agent's (default) window and two of ours.
        self.sweeps = Sweeps(
            settings.state_dir,
            self.jobs,
            self.store,
            settle_s=wire.METRICS_INTERVAL_S + 2 * settings.metrics_interval_s,
        )
        self.api_port = 0
        # What takes work: the REST API and the loops (timeouts, scheduling passes).
        self._serving = contextlib.AsyncExitStack()
        self._loops: list[asyncio.Task[None]] = []
        self._linked = False

    def _check_lead(self) -> None:
        """Refuse to connect or send once another supervisor may lead (a ``LinkDown``)."""
        if self.leadership is not None and not self.leadership.leads():
            raise LinkDown(
                f"not sent: this supervisor's leadership term {self.term} is over "
                f"({self.leadership.lost_reason or 'its lease ran out'})"
            )

    async def _publish(
        self,
        topic: str,
        payload: bytes,
        *,
        retain: bool = False,
        timeout: float = 5.0,
        via: int | None = None,
    ) -> None:
        """The link's publish, for what only the leader may send (commands, catalogs)."""
        self._check_lead()
        await self.link.publish(topic, payload, retain=retain, timeout=timeout, via=via)

    async def _publish_many(
        self, items: Sequence[tuple[str, bytes]], *, retain: bool = False, timeout: float = 5.0
    ) -> list[BaseException | None]:
        """The link's batch (:meth:`MqttLinks.publish_many`), for the leader only: a step's
        catalogs."""
        self._check_lead()
        return await self.link.publish_many(items, retain=retain, timeout=timeout)

    def _route(self, topic: str) -> int | None:
        """The link a command to a node goes out on: the one its heartbeats come through."""
        found = wire.match_node_topic(topic)
        if found is None or found[1] != "cmd":
            return None
        return self._node_via.get(found[0])

    def _flush_soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop yet (a store touched while the daemon is built)
            self._flush_store()
            return
        loop.call_later(WRITE_SOON_S, self._flush_store)

    def _flush_store(self) -> None:
        try:
            self.store.flush()
        except StoreError as exc:
            log.error(
                "%d store write(s) not written yet, trying again: %s", self.store.pending, exc
            )
            asyncio.get_running_loop().call_later(1.0, self._flush_store)

    def _on_slow_nodes(self, slow: Mapping[str, SlowNode]) -> None:
        if self.registry.mark_slow(slow):
            self.jobs.wake()  # a node turned warn or back up: schedule again

    def _gpu_model(self, node: str) -> str | None:
        found = self.registry.nodes.get(node)
        birth = found.birth if found is not None else None
        return birth.gpus[0].model if birth is not None and birth.gpus else None

    async def __aenter__(self) -> Supervisor:
        try:
            await self._serving.enter_async_context(self.loopwatch)
            self.api_port = await self._serving.enter_async_context(start_api(self))
            await self.link.__aenter__()
            self._linked = True
            group = await self._serving.enter_async_context(asyncio.TaskGroup())
            self._loops.append(group.create_task(supervised("timeouts", self._timeout_loop)))
            self._loops.append(group.create_task(supervised("jobs", self.jobs.loop)))
            self._loops.append(group.create_task(supervised("metrics", self.metrics.loop)))
            self._loops.append(group.create_task(supervised("sweeps", self.sweeps.loop)))
            if self.backups is not None:
                self._loops.append(group.create_task(supervised("backup", self.backups.loop)))
            self.jobs.resume()
        except BaseException:
            for task in self._loops:
                task.cancel()
            try:
                await self._serving.aclose()
            finally:
                await self._close(None, None, None)
            raise
        log.info(
            "supervisor up: API on port %d, %d known nodes", self.api_port, len(self.registry.nodes)
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Shut down in this order, within one deadline of ``SHUTDOWN_S`` that the steps
        share (the link's own close is bounded apart, by ``phalanx.link.CLOSE_TIMEOUT_S``):

        1. **Stop accepting.** The retained status says the supervisor is offline; the
           publisher times no batch, retry or linger, and no task of the controller, the
           burn-ins or the publisher starts any more (a job keeps its persisted state,
           which the next supervisor takes up); the loops stop; the REST API stops
           listening, its requests in flight get ``api.SHUTDOWN_S``. The link stays up:
           acks still arrive, and landings and releases are queued.
        2. **Drain.** The landings received are recorded in the store and the catalogs
           they changed published; the releases received clear their catalogs.
        3. **Wait** for the running tasks (launches, stops, recoveries, orphan stops,
           burn-ins, catalog publishes) with what is left of the deadline,
        4. **cancel the rest**, each with a message naming it and the limit.
        5. **Close.** End the waits for acks left (only now: a launch would read its
           cancelled acks as node failures); close the link; record the landings that
           came since the drain, and those of a slice the drain's end cut short
           (their catalogs go out at the next start); close the store (its commit
           thread with it).
        """
        deadline = Deadline(SHUTDOWN_S)
        try:
            await self._stop_accepting(deadline)
            await self.publisher.drain(deadline.left())
            await asyncio.gather(
                self.jobs.shutdown(deadline.left()), self.publisher.shutdown(deadline.left())
            )
        finally:
            await self._close(exc_type, exc, tb)
        log.info("supervisor stopped")

    async def _stop_accepting(self, deadline: Deadline) -> None:
        if self.link.connected:
            status = wire.SupervisorStatus(online=False, since=time.time(), term=self.term)
            with contextlib.suppress(LinkDown):
                await self._publish(
                    wire.SUPERVISOR_STATUS_TOPIC,
                    wire.encode(status),
                    retain=True,
                    timeout=min(2.0, deadline.left(floor=0.1)),
                )
        self.publisher.stop()
        self.jobs.close()
        if self.backups is not None:
            self.backups.close()  # a copy in flight ends at its next step
        for task in self._loops:
            task.cancel()
        await self._serving.aclose()

    async def _close(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.commands.cancel_waits()
        if self.backups is not None:
            self.backups.close()
        try:
            if self._linked:
                await self.link.__aexit__(exc_type, exc, tb)
        finally:
            self.publisher.close()
            try:
                self.metrics.flush()  # the windows heard since the last flush
            except StoreError as exc:
                log.error("the last metrics were not written: %s", exc)
            self.store.close()

    async def _on_connect(self, index: int = 0) -> None:
        others_up = any(self.link.up(i) for i in range(len(self._link_up)) if i != index)
        if self._link_up[index] and others_up:
            self._lost_link(index)  # lost and back between two looks of the timeout loop
        self._link_up[index] = True
        if not others_up:
            self._back_on_the_broker()
        status = wire.SupervisorStatus(online=True, since=self.started_at, term=self.term)
        await self._publish(
            wire.SUPERVISOR_STATUS_TOPIC, wire.encode(status), retain=True, via=index
        )
        await self.publisher.republish(self.jobs.jobs.values())

    def _heard_via(self, node: str, via: int) -> None:
        """A current heartbeat of ``node`` came through link ``via`` (one of an older birth
        does not move it: another link's backlog may be handled late). A node that moved
        to another broker gets the commands still waiting for its ack again there: sent
        on the old one as it left, they would wait in a session it ends before it uses
        again (its ledger runs each id once)."""
        was = self._node_via.get(node)
        self._node_via[node] = via
        if was is not None and was != via:
            log.info(
                "node %s moved to the MQTT broker %s",
                node,
                self.link.broker(via),
                extra={"node": node, "event": "node_moved_broker"},
            )
            self.commands.resend(node)

    def _lost_link(self, index: int) -> None:
        """One broker of several lost, others still up: the nodes heard through it get a
        whole heartbeat timeout to be heard through another (their agents move on to the
        next broker listed), and the last wills it sent as it went down are taken back."""
        now = self.registry.clock()
        moved = [node for node, via in self._node_via.items() if via == index]
        self.registry.heard_now(moved)
        revived = self.registry.revive(now - WILL_SUSPECT_S, only=moved)
        log.warning(
            "lost the MQTT broker %s (the others are up): waiting for its %d node(s) to "
            "reach another%s",
            self.link.broker(index),
            len(moved),
            f"; {', '.join(revived)} went offline by a last will as it went down"
            if revived
            else "",
        )

    def _check_links(self) -> None:
        """Each broker lost since the last look while another is still up: see
        :meth:`_lost_link` (all of them lost: the timeout loop waits for one)."""
        for index, was_up in enumerate(self._link_up):
            if was_up and not self.link.up(index):
                self._link_up[index] = False
                if self.link.connected:
                    self._lost_link(index)

    def _back_on_the_broker(self) -> None:
        # Back on the broker: every node gets a whole heartbeat timeout to be heard again
        # before it is judged offline (it may have been reconnecting too), and the last
        # wills the broker sent as it went down are taken back.
        lost_at = self.link_lost_at
        if lost_at is None and self.link_since is not None:
            # Down and up again between two looks of the timeout loop: it was lost just now.
            lost_at = self.registry.clock() - 1.0
        if lost_at is not None:
            revived = self.registry.revive(lost_at - WILL_SUSPECT_S)
            if revived:
                log.info(
                    "back on the broker: %s went offline by a last will as the "
                    "broker went down; waiting for them to reconnect",
                    ", ".join(revived),
                )
        self.link_lost_at = None
        self.link_since = self.registry.clock()
        self.registry.heard_all_now()

    def offline_confirmed(self, offline_at: float) -> bool:
        """Whether a node offline since ``offline_at`` (registry clock) is offline for sure:
        the supervisor's link has been up, and its messages handled, for
        ``OFFLINE_CONFIRM_S`` since then, or ``offline_after_s`` if many nodes went
        offline with it (``Registry.mass_offline_at``) (a will the
        broker sent as it went down is taken back when the link returns, see
        :meth:`Registry.revive`)."""
        if not self.link.connected or self.link_since is None:
            return False
        # Only as far as the supervisor has handled what it received: a broker that kept
        # the sessions across its restart delivers the wills it sent as it went down
        # first, and the nodes' new births after them, queued behind.
        heard_until = self.registry.clock() - self.link.behind_s
        offline_for = heard_until - max(offline_at, self.link_since)
        if offline_for < OFFLINE_CONFIRM_S:
            return False
        return offline_for >= self.settings.offline_after_s or not self.registry.mass_offline_at(
            offline_at
        )

    async def _on_link_message(self, via: int, topic: str, payload: bytes) -> None:
        await self._on_message(topic, payload, via=via)

    async def _on_message(self, topic: str, payload: bytes, *, via: int = 0) -> None:
        try:
            inbound = wire.parse(topic, payload)
        except wire.WireError as exc:
            self.bad_messages += 1
            log.warning("dropped: %s", exc)
            return
        msg = inbound.message
        self.wire_stats.on_message(msg, time.time())
        match msg:
            case wire.Heartbeat():
                before = self.registry.nodes.get(msg.node)
                state = before.state if before else None
                if not self.registry.on_heartbeat(msg):
                    await self.commands.ask_rebirth(msg.node)
                else:
                    self._heard_via(msg.node, via)
                    self.jobs.on_heartbeat(msg)
                    if self.registry.nodes[msg.node].state != state:
                        self.jobs.wake()
            case wire.RankEvent():
                self.jobs.on_rank_event(msg)
            case wire.RankEvents():
                for event in msg.events:
                    with _each(event):
                        self.jobs.on_rank_event(event)
            case wire.MetricsBatch():
                self.metrics.on_batch(msg)
            case wire.CkptLanding():
                self.publisher.on_landing(msg)
            case wire.CkptLandings():
                for landing in msg.landings:
                    with _each(landing):
                        self.publisher.on_landing(landing)
            case wire.CkptReleased():
                self.publisher.on_release(msg)
            case wire.NodeBirth():
                self.registry.on_birth(msg)
                self.jobs.wake()
            case wire.NodeDeath():
                self.registry.on_death(msg)
                self.jobs.wake()
            case wire.CommandAck():
                self.commands.on_ack(msg)
            case None:
                pass  # a retained message was cleared
            case _:
                log.warning("dropped: unexpected %s on %s", type(msg).__name__, topic)

    async def _timeout_loop(self) -> None:
        interval = max(0.1, min(1.0, self.settings.offline_after_s / 4))
        while True:
            await asyncio.sleep(interval)
            self._check_links()
            if not self.link.connected:
                # Cut off from the broker, the supervisor hears no heartbeat: that says
                # nothing of the nodes (a broker restart is not a failure of every node).
                if self.link_lost_at is None:
                    self.link_lost_at = self.registry.clock()
                    self.link_since = None
                continue
            # Heartbeats waiting in our own queue are no node's silence: a supervisor
            # behind on its messages (busy, or starved of CPU) must not judge its fleet
            # offline and quarantine it.
            if self.registry.check_timeouts(behind_s=self.link.behind_s):
                self.jobs.wake()


@contextlib.contextmanager
def _each(message: wire.RankEvent | wire.CkptLanding) -> Iterator[None]:
    """One message of a batch: one that fails is logged and dropped, the rest of its
    batch is still taken (as each was when it came alone)."""
    try:
        yield
    except Exception:
        log.exception(
            "handler failed on a %s of node %s in a batch; it is dropped",
            message.kind,
            message.node,
        )
