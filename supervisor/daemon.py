"""The supervisor daemon: MQTT in, registry, commands out, REST API for operators."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

from phalanx import wire
from phalanx.link import LinkDown, MqttLink, Will
from phalanx.tasks import supervised
from supervisor.api import start_api
from supervisor.catalog import CheckpointCatalog
from supervisor.config import SupervisorSettings
from supervisor.controller import JobController
from supervisor.errors import CommandTimeout, StoreError
from supervisor.jobs import Job, JobState
from supervisor.registry import NodeState, Registry
from supervisor.store import Store

log = logging.getLogger(__name__)


LANDING_BATCH_S = 0.05
# Last wills that arrive this long before the supervisor loses the broker itself were
# most likely sent by a broker going down, not by dying nodes.
WILL_SUSPECT_S = 5.0
# A node offline is a failure of its jobs once it has been offline this long with the
# supervisor's own link up all along (a broker restart sends every node's will first).
OFFLINE_CONFIRM_S = 2.0
CATALOG_RETRY_S = 2.0
MAX_QUEUED_LANDINGS = 1_000_000  # ~a checkpoint step of 250k ranks at every tier


class Supervisor:
    def __init__(self, settings: SupervisorSettings, token: str) -> None:
        self.settings = settings
        self.token = token
        self.agent_token = ""
        if settings.agent_token_file is not None:
            self.agent_token = settings.agent_token_file.read_text().strip()
        self.store = Store(settings.state_dir / "state.db")
        self.registry = Registry(self.store, offline_after_s=settings.offline_after_s)
        self.started_at = time.time()
        self.bad_messages = 0
        # When the link to the broker last came up (None: down) and went down, on the
        # registry's clock: a node offline is acted on only once the link stayed up.
        self.link_since: float | None = None
        self.link_lost_at: float | None = None
        self._acks: dict[str, asyncio.Future[wire.CommandAck]] = {}
        self._rebirth_asked: dict[str, float] = {}
        self.link = MqttLink(
            settings.mqtt.resolved(),
            "phalanx-supervisor",
            subscriptions=wire.SUPERVISOR_SUBSCRIPTIONS,
            handler=self._on_message,
            will=lambda: Will(
                wire.SUPERVISOR_STATUS_TOPIC,
                wire.encode(wire.SupervisorStatus(online=False, since=time.time())),
            ),
            on_connect=self._on_connect,
            persistent_session=True,  # rank events sent while we restart are queued for us
        )
        self.catalog = CheckpointCatalog(self.store)
        self._catalog_sent: dict[str, bytes] = {}  # topic -> the payload last published
        self._landings: list[wire.CkptLanding] = []
        self._landing_flush: asyncio.TimerHandle | None = None
        self._releases: list[wire.CkptReleased] = []
        self._release_flush: asyncio.TimerHandle | None = None
        self._catalog_retry: asyncio.TimerHandle | None = None
        self._catalog_retry_jobs: set[str] = set()
        self._catalog_locks: dict[str, asyncio.Lock] = {}
        self._catalog_tasks: set[asyncio.Task[None]] = set()
        # Catalog messages are built here, off the event loop: for a 16,384-rank job one
        # build took 1.5-1.9 s (SQLite rows and pydantic models), which held heartbeats.
        self._catalog_builder = ThreadPoolExecutor(1, thread_name_prefix="catalog")
        self._ram_lingers: dict[str, asyncio.TimerHandle] = {}  # failed job -> RAM freed then
        self._closed = False
        self.jobs = JobController(self)
        self.api_port = 0
        self._stack = contextlib.AsyncExitStack()
        self._loops: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Supervisor:
        await self._stack.__aenter__()
        try:
            self.api_port = await self._stack.enter_async_context(start_api(self))
            await self._stack.enter_async_context(self.link)
            group = await self._stack.enter_async_context(asyncio.TaskGroup())
            self._loops.append(group.create_task(supervised("timeouts", self._timeout_loop)))
            self._loops.append(group.create_task(supervised("jobs", self.jobs.loop)))
            self.jobs.resume()
        except BaseException:
            await self._stack.__aexit__(None, None, None)
            self.store.close()
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
        if self.link.connected:
            status = wire.SupervisorStatus(online=False, since=time.time())
            with contextlib.suppress(LinkDown):
                await self.link.publish(
                    wire.SUPERVISOR_STATUS_TOPIC, wire.encode(status), retain=True, timeout=2.0
                )
        for task in self._loops:
            task.cancel()
        # Job tasks first: cancelled acks would otherwise read as node failures to a launch.
        await self.jobs.close()
        for future in self._acks.values():
            future.cancel()
        await self._stack.__aexit__(exc_type, exc, tb)
        # The link is closed: no landing comes any more. Record those acknowledged to the
        # broker (the catalogs are published again on the next start).
        self._closed = True
        for handle in (
            self._landing_flush,
            self._release_flush,
            self._catalog_retry,
            *self._ram_lingers.values(),
        ):
            if handle is not None:
                handle.cancel()
        for task in list(self._catalog_tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            self._record_landings()
        self._catalog_builder.shutdown(wait=True)
        self.store.close()
        log.info("supervisor stopped")

    async def _on_connect(self) -> None:
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
        status = wire.SupervisorStatus(online=True, since=self.started_at)
        await self.link.publish(wire.SUPERVISOR_STATUS_TOPIC, wire.encode(status), retain=True)
        self._catalog_sent.clear()  # the broker may have lost retained messages: send again
        for job in list(self.jobs.jobs.values()):
            if job.state.final and self.store.ended_catalogs_released(job.id):
                continue  # every node let go of it: nothing left to tell
            if not job.state.final or self.store.commits(job.id):
                await self.publish_catalog(job.id)

    async def publish_catalog(self, job_id: str) -> None:
        """The job's committed checkpoints, one retained message per node that needs them
        (an unchanged one is not sent again).

        One publish per job at a time: messages built before another change must all be
        out before the next are built, or a stale one could stay retained on a node while
        the cache says it is current. A publish the link refuses is tried again."""
        lock = self._catalog_locks.setdefault(job_id, asyncio.Lock())
        async with lock:
            job = self.jobs.jobs.get(job_id)
            if job is None:
                return
            ended = self._ram_freed(job)
            placement = {} if job.state.final else {p.rank: p.node for p in job.ranks}
            peers, alive = {}, set()
            for node in self.registry.nodes.values():
                if node.state != NodeState.OFFLINE:
                    alive.add(node.id)
                if node.birth is not None and node.birth.http_port:
                    peers[node.id] = wire.PeerAddr(
                        node=node.id, address=node.birth.address, http_port=node.birth.http_port
                    )
            world_size, generation, nodes = job.spec.world_size, job.generation, job.nodes

            def build() -> list[tuple[str, str, bytes]]:
                with self.store.snapshot() as snapshot:  # committed rows only, one state
                    messages = self.catalog.messages(
                        job_id,
                        world_size,
                        generation=generation,
                        placement=placement,
                        peers=peers,
                        alive=alive,
                        ended=ended,
                        nodes=nodes,
                        store=snapshot,
                    )
                return [
                    (m.node, wire.catalog_topic(job_id, m.node), wire.encode(m)) for m in messages
                ]

            try:
                built = await asyncio.get_running_loop().run_in_executor(
                    self._catalog_builder, build
                )
                if ended:
                    # A node that let go of the job needs nothing more; the others' rows go
                    # in before the first message is out, as its release may come at once.
                    done = self.store.ended_catalogs_let_go(job_id)
                    built = [m for m in built if m[0] not in done]
                    self.store.ended_catalogs_sent(job_id, [target for target, _, _ in built])
            except StoreError as exc:
                log.error(
                    "job %s: cannot build the checkpoint catalog: %s: trying again", job_id, exc
                )
                self._catalog_retry_jobs.add(job_id)
                self._schedule(CATALOG_RETRY_S, "_catalog_retry", self._retry_catalogs)
                return
            for target, topic, payload in built:
                if self._catalog_sent.get(topic) == payload:
                    continue
                try:
                    await self.link.publish(topic, payload, retain=True)
                except LinkDown as exc:
                    log.warning(
                        "job %s: the checkpoint catalog for %s was not published (%s): "
                        "trying again",
                        job_id,
                        target,
                        exc,
                    )
                    self._catalog_retry_jobs.add(job_id)
                    self._schedule(CATALOG_RETRY_S, "_catalog_retry", self._retry_catalogs)
                    return
                self._catalog_sent[topic] = payload
            if ended:  # out, retained: the cache of a job that will not change need not stay
                prefix = wire.catalog_prefix(job_id)
                for topic in [t for t in self._catalog_sent if t.startswith(prefix)]:
                    del self._catalog_sent[topic]
                self.catalog.forget_job(job_id)

    async def flush_releases(self) -> None:
        """Clear the catalogs of ended jobs that nodes let go of since the last flush."""
        batch, self._releases = self._releases, []
        nodes: dict[str, set[str]] = {}
        for msg in batch:
            nodes.setdefault(msg.job, set()).add(msg.node)
        for job, let_go in sorted(nodes.items()):
            await self.clear_ended_catalogs(job, let_go)

    async def clear_ended_catalogs(self, job: str, let_go: set[str]) -> None:
        """Nodes let go of an ended job: clear the job's catalog retained for each, so the
        broker stops delivering it at every reconnect.

        Every release clears, even one for a node cleared before: the clear goes out
        after the catalog that node answered, and under the job's publish lock, so no
        catalog is left retained behind it. A clear the link refuses waits for the next
        release (the agent gets the catalog again when it reconnects)."""
        cleared: list[str] = []
        try:
            async with self._catalog_locks.setdefault(job, asyncio.Lock()):
                try:
                    for node in sorted(let_go & self.store.ended_catalogs_sent_to(job)):
                        await self.link.publish(wire.catalog_topic(job, node), b"", retain=True)
                        cleared.append(node)
                finally:
                    if cleared:
                        self.store.ended_catalogs_cleared(job, cleared, time.time())
                released = self.store.ended_catalogs_released(job)
        except (LinkDown, StoreError) as exc:
            log.warning(
                "job %s: ended catalogs not cleared for %s: %s",
                job,
                ", ".join(sorted(let_go - set(cleared))),
                exc,
            )
            return
        if released and cleared:
            log.info("job %s: every node let go of its checkpoints; its catalogs are cleared", job)

    def _ram_freed(self, job: Job) -> bool:
        """Whether the job's nodes free its RAM tier now (the catalog says ``ended``): it
        succeeded or was cancelled, or it failed ``ckpt_failed_ram_linger_s`` ago. A job
        that failed later than that gets its catalog sent again when the time is up."""
        if job.state in (JobState.SUCCEEDED, JobState.CANCELLED):
            return True
        if job.state is not JobState.FAILED:
            return False
        left = (job.ended_at or 0.0) + self.settings.ckpt_failed_ram_linger_s - time.time()
        if left <= 0:
            return True
        if job.id not in self._ram_lingers and not self._closed:

            def fire() -> None:
                self._ram_lingers.pop(job.id, None)
                task = asyncio.create_task(self.publish_catalog(job.id), name="ckpt-free-ram")
                self._catalog_tasks.add(task)
                task.add_done_callback(self._catalog_tasks.discard)

            self._ram_lingers[job.id] = asyncio.get_running_loop().call_later(left, fire)
        return False

    def offline_confirmed(self, offline_at: float) -> bool:
        """Whether a node offline since ``offline_at`` (registry clock) is offline for sure:
        the supervisor's link has been up for ``OFFLINE_CONFIRM_S`` since then (a will the
        broker sent as it went down is taken back when the link returns, see
        :meth:`Registry.revive`)."""
        if not self.link.connected or self.link_since is None:
            return False
        return self.registry.clock() - max(offline_at, self.link_since) >= OFFLINE_CONFIRM_S

    def _schedule(
        self, delay: float, slot: str, fn: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        """Run ``fn`` once, ``delay`` seconds from now, unless already scheduled in ``slot``."""
        if self._closed or getattr(self, slot) is not None:
            return

        def fire() -> None:
            setattr(self, slot, None)
            task = asyncio.create_task(fn(), name=slot.strip("_"))
            self._catalog_tasks.add(task)
            task.add_done_callback(self._catalog_tasks.discard)

        setattr(self, slot, asyncio.get_running_loop().call_later(delay, fire))

    async def _retry_catalogs(self) -> None:
        jobs, self._catalog_retry_jobs = self._catalog_retry_jobs, set()
        for job_id in sorted(jobs):
            await self.publish_catalog(job_id)

    def _record_landings(self) -> set[str]:
        """Record the queued landings in one transaction; the jobs whose catalog changed.
        On a store error the landings go back to the queue (acknowledged to the broker,
        they exist nowhere else) and are tried again. Any other error is one landing the
        store cannot take (a value past what it holds): that one is logged and dropped,
        and it never holds up the others."""
        batch, self._landings = self._landings, []

        def record(msgs: list[wire.CkptLanding]) -> set[str]:
            changed: set[str] = set()
            try:
                with self.store.batch():
                    for msg in msgs:
                        job = self.jobs.jobs.get(msg.job)
                        if job is None:
                            log.warning("dropped: a checkpoint landing of unknown job %s", msg.job)
                        elif self.catalog.on_landing(msg, job.spec.world_size):
                            changed.add(msg.job)
            except BaseException:
                self.catalog.forget()  # the transaction was rolled back: so is what it counted
                raise
            return changed

        def requeue(msgs: list[wire.CkptLanding], exc: StoreError) -> None:
            self._landings[:0] = msgs[-MAX_QUEUED_LANDINGS:]
            lost = len(self._landings) - MAX_QUEUED_LANDINGS
            if lost > 0:
                del self._landings[:lost]
                log.error(
                    "dropped the %d oldest checkpoint landings: the store has failed for too long",
                    lost,
                )
            log.error("recording %d checkpoint landing(s) failed, trying again: %s", len(msgs), exc)

        # One transaction for the batch; a batch that fails for any reason but the store is
        # split in halves until the landing that fails stands alone (a few transactions,
        # never one per landing).
        pending, changed = [batch], set()
        while pending:
            chunk = pending.pop(0)
            try:
                changed |= record(chunk)
            except StoreError as exc:
                requeue([msg for part in (chunk, *pending) for msg in part], exc)
                if changed:  # recorded: their catalogs go out with the retry of catalogs
                    self._catalog_retry_jobs |= changed
                    self._schedule(CATALOG_RETRY_S, "_catalog_retry", self._retry_catalogs)
                raise
            except Exception as exc:
                if len(chunk) > 1:
                    pending[:0] = [chunk[: len(chunk) // 2], chunk[len(chunk) // 2 :]]
                    continue
                log.error(
                    "dropped a checkpoint landing the store cannot take: %r: %s",
                    exc,
                    chunk[0].model_dump_json()[:500],
                )
        return changed

    async def flush_landings(self) -> None:
        """Record the landings received since the last flush, then publish the catalogs
        that changed."""
        if self._landing_flush is not None:
            self._landing_flush.cancel()
            self._landing_flush = None
        try:
            changed = self._record_landings()
        except Exception:
            self._schedule(CATALOG_RETRY_S, "_landing_flush", self.flush_landings)
            return
        for job_id in sorted(changed):
            await self.publish_catalog(job_id)

    async def _on_message(self, topic: str, payload: bytes) -> None:
        try:
            inbound = wire.parse(topic, payload)
        except wire.WireError as exc:
            self.bad_messages += 1
            log.warning("dropped: %s", exc)
            return
        msg = inbound.message
        match msg:
            case wire.Heartbeat():
                before = self.registry.nodes.get(msg.node)
                state = before.state if before else None
                if not self.registry.on_heartbeat(msg):
                    await self._ask_rebirth(msg.node)
                else:
                    self.jobs.on_heartbeat(msg)
                    if self.registry.nodes[msg.node].state != state:
                        self.jobs.wake()
            case wire.RankEvent():
                self.jobs.on_rank_event(msg)
            case wire.CkptLanding():
                # A step brings a landing per rank and tier: record them in batches.
                self._landings.append(msg)
                self._schedule(LANDING_BATCH_S, "_landing_flush", self.flush_landings)
            case wire.CkptReleased():
                # Every node of an ended job answers at once: clear them in batches, off this
                # loop, which heartbeats and acks must never queue behind.
                self._releases.append(msg)
                self._schedule(LANDING_BATCH_S, "_release_flush", self.flush_releases)
            case wire.NodeBirth():
                self.registry.on_birth(msg)
                self.jobs.wake()
            case wire.NodeDeath():
                self.registry.on_death(msg)
                self.jobs.wake()
            case wire.CommandAck():
                future = self._acks.pop(msg.id, None)
                if future is not None and not future.done():
                    future.set_result(msg)
            case None:
                pass  # a retained message was cleared
            case _:
                log.warning("dropped: unexpected %s on %s", type(msg).__name__, topic)

    async def _ask_rebirth(self, node: str) -> None:
        """A heartbeat from a node whose birth we lack: ask it to announce itself again."""
        now = time.monotonic()
        if now - self._rebirth_asked.get(node, -1e9) < 5.0:
            return
        self._rebirth_asked[node] = now
        log.info("heartbeat from %s without a known birth; asking for a rebirth", node)
        cmd = wire.Command.new(node, wire.RebirthArgs(), ttl=self.settings.command_timeout_s)
        with contextlib.suppress(LinkDown):
            await self.link.publish(wire.command_topic(node), wire.encode(cmd), timeout=2.0)

    async def command(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck:
        """Send one command and wait for its ack (the deadline is the timeout)."""
        self.registry.get(node)
        timeout = timeout or self.settings.command_timeout_s
        cmd = wire.Command.new(node, args, ttl=timeout)
        future: asyncio.Future[wire.CommandAck] = asyncio.get_running_loop().create_future()
        self._acks[cmd.id] = future
        try:
            await self.link.publish(wire.command_topic(node), wire.encode(cmd), timeout=timeout)
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise CommandTimeout(node, args.op, cmd.id, timeout) from None
        finally:
            self._acks.pop(cmd.id, None)

    async def _timeout_loop(self) -> None:
        interval = max(0.1, min(1.0, self.settings.offline_after_s / 4))
        while True:
            await asyncio.sleep(interval)
            if not self.link.connected:
                # Cut off from the broker, the supervisor hears no heartbeat: that says
                # nothing of the nodes (a broker restart is not a failure of every node).
                if self.link_lost_at is None:
                    self.link_lost_at = self.registry.clock()
                    self.link_since = None
                continue
            if self.registry.check_timeouts():
                self.jobs.wake()
