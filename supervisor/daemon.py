"""The supervisor daemon: MQTT in, registry, commands out, REST API for operators."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import TracebackType

from phalanx import wire
from phalanx.link import LinkDown, MqttLink, Will
from phalanx.tasks import supervised
from supervisor.api import start_api
from supervisor.catalog import CheckpointCatalog
from supervisor.config import SupervisorSettings
from supervisor.controller import JobController
from supervisor.jobs import JobState
from supervisor.registry import Registry
from supervisor.store import Store

log = logging.getLogger(__name__)


class CommandTimeout(TimeoutError):
    pass


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
        self._acks: dict[str, asyncio.Future[wire.CommandAck]] = {}
        self._rebirth_asked: dict[str, float] = {}
        self.link = MqttLink(
            settings.mqtt.resolved(),
            "phalanx-supervisor",
            subscriptions=wire.SUPERVISOR_SUBSCRIPTIONS,
            handler=self._on_message,
            will=lambda: Will(wire.SUPERVISOR_STATUS_TOPIC,
                              wire.encode(wire.SupervisorStatus(online=False, since=time.time()))),
            on_connect=self._on_connect,
            persistent_session=True,  # rank events sent while we restart are queued for us
        )
        self.catalog = CheckpointCatalog(self.store)
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
        log.info("supervisor up: API on port %d, %d known nodes", self.api_port,
                 len(self.registry.nodes))
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
                await self.link.publish(wire.SUPERVISOR_STATUS_TOPIC, wire.encode(status),
                                        retain=True, timeout=2.0)
        for task in self._loops:
            task.cancel()
        # Job tasks first: cancelled acks would otherwise read as node failures to a launch.
        await self.jobs.close()
        for future in self._acks.values():
            future.cancel()
        await self._stack.__aexit__(exc_type, exc, tb)
        self.store.close()
        log.info("supervisor stopped")

    async def _on_connect(self) -> None:
        status = wire.SupervisorStatus(online=True, since=self.started_at)
        await self.link.publish(wire.SUPERVISOR_STATUS_TOPIC, wire.encode(status), retain=True)
        for job in list(self.jobs.jobs.values()):
            if self.store.commits(job.id):
                await self.publish_catalog(job.id)

    async def publish_catalog(self, job_id: str) -> None:
        """The job's committed checkpoints, retained, for its agents."""
        job = self.jobs.jobs.get(job_id)
        if job is None:
            return
        msg = self.catalog.message(job_id, job.spec.world_size).model_copy(update={
            "ended": job.state in (JobState.SUCCEEDED, JobState.CANCELLED)})
        with contextlib.suppress(LinkDown):
            await self.link.publish(wire.catalog_topic(job_id), wire.encode(msg), retain=True)

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
                job = self.jobs.jobs.get(msg.job)
                if job is None:
                    log.warning("dropped: a checkpoint landing of unknown job %s", msg.job)
                elif self.catalog.on_landing(msg, job.spec.world_size):
                    await self.publish_catalog(msg.job)
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

    async def command(self, node: str, args: wire.CommandArgsType,
                      timeout: float | None = None) -> wire.CommandAck:
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
            raise CommandTimeout(
                f"no ack from node {node!r} for {args.op} command {cmd.id} within {timeout:.1f}s"
            ) from None
        finally:
            self._acks.pop(cmd.id, None)

    async def _timeout_loop(self) -> None:
        interval = max(0.1, min(1.0, self.settings.offline_after_s / 4))
        while True:
            await asyncio.sleep(interval)
            if self.registry.check_timeouts():
                self.jobs.wake()
