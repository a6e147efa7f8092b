"""Checkpoint catalogs out: every node of a job is told the job's committed checkpoints.

The supervisor hands the publisher each checkpoint landing and release a node
reports (:meth:`CatalogPublisher.on_landing`, :meth:`~CatalogPublisher.on_release`).
Landings are recorded in batches (one store transaction per ``BATCH_S``: a step
brings one per rank and tier), and each job whose catalog changed gets it
published: one retained message per node, built on the event loop in slices
(``BUILD_SLICE_S``), sent only when it changed. A
release (a node let go of an ended job) clears that node's retained catalog, in
batches too. A publish the link refuses, or a batch the store refuses, is tried
again after ``RETRY_S``. A failed job's catalog says ``ended`` (its nodes free its
RAM tier) once ``ckpt_failed_ram_linger_s`` is over.

Each of these delays is a :class:`OneShot`; the work they start runs as tasks of
the publisher's own :class:`~phalanx.tasks.Tasks`. Shutdown, in the supervisor's
order: :meth:`~CatalogPublisher.stop` (no new timer), :meth:`~CatalogPublisher.drain`
(what was received is recorded and sent while the link is up),
:meth:`~CatalogPublisher.shutdown` (the tasks: waited for, then cancelled), and
:meth:`~CatalogPublisher.close` once the link is closed (what came since is recorded).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from phalanx import wire
from phalanx.agent_tokens import AgentKeys
from phalanx.link import LinkDown, Publish, PublishMany
from phalanx.tasks import Tasks
from supervisor import gcdefer
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.errors import StoreError
from supervisor.fleet.registry import NodeState, Registry
from supervisor.jobs import Job, JobState, hold_steps, void_landing
from supervisor.store_db import DB_ERRORS

log = logging.getLogger(__name__)

PUBLISH_AT_ONCE = 256  # catalogs in flight at once through ``publish`` (no ``publish_many``)
# What reading the job's rows on the store's connection may raise: a StoreError, or
# SQLite's own error where it is not corruption (PostgreSQL's come as StoreError).
PIN_ERRORS: tuple[type[Exception], ...] = (StoreError, *DB_ERRORS)
BATCH_S = 0.05  # landings and releases received within this are handled together
RECORD_AT_ONCE = 512  # landings recorded in one transaction, one turn of the event loop
RETRY_S = 2.0  # a catalog the link refused, or landings the store refused, go again after
BUILD_SLICE_S = 0.02  # a build of catalogs lets the event loop run at least this often
MAX_QUEUED_LANDINGS = 1_000_000  # ~a checkpoint step of 250k ranks at every tier
KEEP_PUBLISHES = 32  # the last publishes' account kept for GET /v1/stats


JobLookup = Callable[[str], Job | None]


class OneShot:
    """One piece of work run once, ``delay`` seconds after :meth:`start`, as a task of
    ``tasks`` named ``name``. Started again while it waits, the first time holds; after
    :meth:`close` it never starts again."""

    def __init__(
        self, name: str, work: Callable[[], Coroutine[Any, Any, None]], tasks: Tasks
    ) -> None:
        self.name = name
        self._work = work
        self._tasks = tasks
        self._handle: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def pending(self) -> bool:
        return self._handle is not None

    def start(self, delay: float) -> None:
        if self._closed or self._handle is not None:
            return
        self._handle = asyncio.get_running_loop().call_later(delay, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def close(self) -> None:
        self.cancel()
        self._closed = True

    def _fire(self) -> None:
        self._handle = None
        self._tasks.spawn(self._work(), name=self.name)


class CatalogPublisher:
    """``catalog`` records the landings (in its store); ``publish`` is the link's, and
    ``publish_many`` its batch (:meth:`~phalanx.link.MqttLinks.publish_many`; without it,
    ``publish`` each message, ``PUBLISH_AT_ONCE`` at a time); ``job`` finds a job by id;
    ``registry`` says which nodes are alive and where their agents listen;
    ``ram_linger_s`` is ``ckpt_failed_ram_linger_s``."""

    def __init__(
        self,
        catalog: CheckpointCatalog,
        publish: Publish,
        *,
        job: JobLookup,
        registry: Registry,
        ram_linger_s: float,
        agent_keys: AgentKeys | None = None,
        publish_many: PublishMany | None = None,
    ) -> None:
        self.catalog = catalog
        self.store = catalog.store
        self._publish = publish
        self._publish_many: PublishMany = publish_many or self._publish_each
        self._room = asyncio.Semaphore(PUBLISH_AT_ONCE)  # publish's, in flight (_publish_each)
        self._job = job
        self._registry = registry
        self._ram_linger_s = ram_linger_s
        self._agent_keys = agent_keys if agent_keys is not None else AgentKeys("")
        self.tasks = Tasks("checkpoint catalogs")
        self._sent: dict[str, bytes] = {}  # topic -> the payload last published
        self._locks: dict[str, asyncio.Lock] = {}  # job -> held while its catalogs go out
        # Publishes asked for, per job, and how many of them the last one sent covers: one
        # that waited for the lock while another began after it was asked needs no build
        # of its own (the four tiers of a step commit within seconds of one another, and
        # each would otherwise wait for a build of the 16,384-rank job of its own).
        self._asked: dict[str, int] = {}
        self._covered: dict[str, int] = {}
        self._landings: list[wire.CkptLanding] = []
        self._releases: list[wire.CkptReleased] = []
        self._retry_jobs: set[str] = set()
        self._landing_flush = OneShot("ckpt-landings", self.flush_landings, self.tasks)
        # Held by a flush of the landings: one that starts while another awaits its
        # commits waits for it (a landing and a later drop of the same shard, recorded out
        # of order, would leave the drop undone).
        self._flushing = asyncio.Lock()
        self._release_flush = OneShot("ckpt-releases", self.flush_releases, self.tasks)
        self._retry = OneShot("ckpt-catalog-retry", self._retry_catalogs, self.tasks)
        self._lingers: dict[str, OneShot] = {}  # failed job -> its RAM freed then
        self._stopped = False
        # (registry version, every node's peer address, the nodes not offline): kept while
        # the registry's version stands (see _fleet).
        self._fleet_seen: tuple[int, dict[str, wire.PeerAddr], frozenset[str]] | None = None
        # The last publishes, each: when it began, how long it waited for the job's lock,
        # built and sent, how many nodes' messages it made and sent (GET /v1/stats).
        self.published: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP_PUBLISHES)
        # The last flushes of landings: how many, and how long they took to record.
        self.recorded: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP_PUBLISHES)

    # --- inbound ------------------------------------------------------------------

    def on_landing(self, msg: wire.CkptLanding) -> None:
        """A step brings a landing per rank and tier: they are recorded in batches."""
        self._landings.append(msg)
        self._landing_flush.start(BATCH_S)

    def on_release(self, msg: wire.CkptReleased) -> None:
        """Every node of an ended job answers at once: they are cleared in batches, off the
        message loop, which heartbeats and acks must never queue behind."""
        self._releases.append(msg)
        self._release_flush.start(BATCH_S)

    @property
    def lingering(self) -> set[str]:
        """The failed jobs whose catalog goes out again when their RAM linger is over."""
        return set(self._lingers)

    # --- publishing -----------------------------------------------------------------

    async def republish(self, jobs: Iterable[Job]) -> None:
        """Back on the broker, which may have lost retained messages: send every catalog a
        node may still need again."""
        self._sent.clear()
        if self.catalog.rows.purging:  # retired by a supervisor that stopped: go on
            self._landing_flush.start(BATCH_S)
        for job in list(jobs):
            if job.state.final and self.catalog.rows.ended_catalogs_released(job.id):
                continue  # every node let go of it: nothing left to tell
            if not job.state.final or self.catalog.rows.commits(job.id):
                await self.publish(job.id)

    def publish_soon(self, job_id: str) -> None:
        """Publish the job's catalogs in a task of their own (the caller goes on)."""
        self.tasks.spawn(self.publish(job_id), name=f"ckpt-catalog-{job_id}")

    async def publish(self, job_id: str) -> None:
        """The job's committed checkpoints, one retained message per node that needs them
        (an unchanged one is not sent again).

        One publish per job at a time: messages built before another change must all be
        out before the next are built, or a stale one could stay retained on a node while
        the cache says it is current. A publish the link refuses is tried again. Asked
        for while another waits for its turn, it returns with that one (which is built
        from what is known when it begins, after both were asked for)."""
        asked = self._asked[job_id] = self._asked.get(job_id, 0) + 1
        asked_at = time.time()
        async with self._locks.setdefault(job_id, asyncio.Lock()):
            if self._covered.get(job_id, 0) >= asked:
                return  # a publish that began after this one was asked for sent it all
            began = self._asked[job_id]
            began_at = time.time()
            job = self._job(job_id)
            if job is None:
                return
            ended = self._ram_freed(job)
            placement = {} if job.state.final else {p.rank: p.node for p in job.ranks}
            peers, alive = self._fleet()
            world_size, generation, nodes = job.world_size, job.generation, job.nodes
            hold = hold_steps(job)
            elastic, sharded = job.spec.reshapes, job.spec.reshards
            try:
                pinned, rows = self.catalog.pin_rows(job_id)
            except PIN_ERRORS as exc:
                log.error(
                    "job %s: cannot build the checkpoint catalog: %s: trying again", job_id, exc
                )
                self._retry_later({job_id})
                return

            built: list[tuple[str, str, bytes]] = []
            # What is handed to the link: (node, topic, payload) each, and their results.
            handed: list[tuple[list[tuple[str, str, bytes]], asyncio.Future[Any]]] = []
            chunk: list[tuple[str, str, bytes]] = []

            def hand() -> None:
                nonlocal chunk
                if chunk:
                    items = [(topic, payload) for _, topic, payload in chunk]
                    sending = self._publish_many(items, retain=True)
                    handed.append((chunk, asyncio.ensure_future(sending)))
                    chunk = []

            failure: BaseException | None = None
            try:
                # On the event loop, in slices: in a thread of its own, a build held the
                # GIL against the loop, whose every socket and SQLite call then waited up
                # to the interpreter's switch interval (5 ms) to take it back: at 2,048
                # nodes each checkpoint's builds stalled the supervisor's messages for
                # seconds (issue 22). Its reads are all made before its first message, in
                # the same turn of the loop as the pin, on the store's own connection
                # (outside any batch: committed rows only); what is written while it goes
                # on is the next build's (keep_rows keeps no row written since the pin).
                # Each slice's changed messages go to the link as the next begins, so that
                # the broker takes them while the rest are built: a 2,048-node step's
                # build and hand-off took 0.3-0.8 s each, one after the other (issue 22).
                # Not an ended job's: its nodes' rows go in before the first is out.
                made = self.catalog.iter_payloads(
                    job_id,
                    world_size,
                    generation=generation,
                    placement=placement,
                    peers=peers,
                    alive=alive,
                    ended=ended,
                    nodes=nodes,
                    credential=self._agent_keys.peer_credential,
                    hold_steps=hold,
                    elastic=elastic,
                    sharded=sharded,
                    rows=rows,
                )
                sliced = time.perf_counter()
                for m, payload in made:
                    if not built:
                        job.published_restore = m.restore_step
                    topic = wire.catalog_topic(job_id, m.node)
                    built.append((m.node, topic, payload))
                    if not ended and self._sent.get(topic) != payload:
                        chunk.append((m.node, topic, payload))
                    if time.perf_counter() - sliced >= BUILD_SLICE_S:
                        hand()
                        await asyncio.sleep(0)  # the loop's messages, HTTP, timers
                        sliced = time.perf_counter()
                self.catalog.keep_rows(job_id, pinned, rows)
                if ended:
                    # A node that let go of the job needs nothing more; the others' rows go
                    # in before the first message is out, as its release may come at once.
                    done = self.catalog.rows.ended_catalogs_let_go(job_id)
                    built = [m for m in built if m[0] not in done]
                    self.catalog.rows.ended_catalogs_sent(
                        job_id, [target for target, _, _ in built]
                    )
                    chunk = [m for m in built if self._sent.get(m[1]) != m[2]]
                hand()
            except PIN_ERRORS as exc:
                failure = exc
            except BaseException:
                for _, sending in handed:
                    sending.cancel()
                raise
            built_at = time.time()
            refused: list[tuple[str, BaseException]] = []
            failed: BaseException | None = None
            sent = 0
            for sending_chunk, sending in handed:
                try:
                    results = await sending
                except LinkDown as exc:  # every one of them (no longer the leader)
                    results = [exc] * len(sending_chunk)
                except asyncio.CancelledError:
                    for _, rest in handed:
                        rest.cancel()
                    raise
                except Exception as exc:
                    failed = failed or exc
                    results = [exc] * len(sending_chunk)
                for (target, topic, payload), result in zip(sending_chunk, results, strict=True):
                    if result is None:
                        self._sent[topic] = payload
                        sent += 1
                    else:
                        refused.append((target, result))
                        if not isinstance(result, LinkDown):
                            failed = failed or result
            self.published.append(
                {
                    "job": job_id,
                    "at": round(asked_at, 3),
                    "wait_s": round(began_at - asked_at, 3),
                    "build_s": round(built_at - began_at, 3),
                    "send_s": round(time.time() - built_at, 3),
                    "messages": len(built),
                    "sent": sent,
                }
            )
            if failure is not None:
                log.error(
                    "job %s: cannot build the checkpoint catalog: %s: trying again", job_id, failure
                )
                self._retry_later({job_id})
                return
            if failed is not None:
                self._retry_later({job_id})
                raise failed
            if refused:
                log.warning(
                    "job %s: the checkpoint catalog for %s%s was not published (%s): trying again",
                    job_id,
                    refused[0][0],
                    f" and {len(refused) - 1} other node(s)" if len(refused) > 1 else "",
                    refused[0][1],
                )
                self._retry_later({job_id})
                return
            self._covered[job_id] = max(self._covered.get(job_id, 0), began)
            if ended:  # out, retained: the cache of a job that will not change need not stay
                prefix = wire.catalog_prefix(job_id)
                for topic in [t for t in self._sent if t.startswith(prefix)]:
                    del self._sent[topic]
                self.catalog.forget_job(job_id)

    async def _publish_each(
        self, items: Sequence[tuple[str, bytes]], *, retain: bool = False, timeout: float = 5.0
    ) -> list[BaseException | None]:
        """``publish_many`` through ``publish``: each message a publish of its own, at most
        ``PUBLISH_AT_ONCE`` in flight (each publish's timeout runs from its start, and one
        queued behind thousands in the client would time out unsent)."""
        room = self._room  # one for every batch: a build hands several

        async def send(topic: str, payload: bytes) -> None:
            async with room:
                await self._publish(topic, payload, retain=retain, timeout=timeout)

        results = await asyncio.gather(
            *(send(topic, payload) for topic, payload in items), return_exceptions=True
        )
        for result in results:
            if isinstance(result, asyncio.CancelledError):
                raise result
        return [result if isinstance(result, BaseException) else None for result in results]

    def _fleet(self) -> tuple[dict[str, wire.PeerAddr], frozenset[str]]:
        """Every node's peer address and the nodes not offline, as the registry has them,
        made again only when its version changed (a node's state or birth). Made at every
        publish, 2,048 nodes' addresses took 27 % of the supervisor's CPU with 256 small
        jobs beside a big one (issue 22). Never changed once made: a build in progress
        goes on reading them."""
        version = self._registry.version
        if self._fleet_seen is None or self._fleet_seen[0] != version:
            peers, alive = {}, set()
            for node in self._registry.nodes.values():
                if node.state != NodeState.OFFLINE:
                    alive.add(node.id)
                if node.birth is not None and node.birth.http_port:
                    peers[node.id] = wire.PeerAddr(
                        node=node.id, address=node.birth.address, http_port=node.birth.http_port
                    )
            self._fleet_seen = (version, peers, frozenset(alive))
        return self._fleet_seen[1], self._fleet_seen[2]

    def _ram_freed(self, job: Job) -> bool:
        """Whether the job's nodes free its RAM tier now (the catalog says ``ended``): it
        succeeded or was cancelled, or it failed ``ram_linger_s`` ago. A job that failed
        later than that gets its catalog sent again when the time is up."""
        if job.state in (JobState.SUCCEEDED, JobState.CANCELLED):
            return True
        if job.state is not JobState.FAILED:
            return False
        left = (job.ended_at or 0.0) + self._ram_linger_s - time.time()
        if left <= 0:
            return True
        if job.id not in self._lingers and not self._stopped:
            job_id = job.id
            timer = OneShot(
                f"ckpt-free-ram-{job_id}", lambda: self._linger_over(job_id), self.tasks
            )
            self._lingers[job_id] = timer
            timer.start(left)
        return False

    async def _linger_over(self, job_id: str) -> None:
        self._lingers.pop(job_id, None)
        await self.publish(job_id)

    def _retry_later(self, jobs: set[str]) -> None:
        self._retry_jobs |= jobs
        self._retry.start(RETRY_S)

    async def _retry_catalogs(self) -> None:
        jobs, self._retry_jobs = self._retry_jobs, set()
        for job_id in sorted(jobs):
            await self.publish(job_id)

    # --- releases -------------------------------------------------------------------

    async def flush_releases(self) -> None:
        """Clear the catalogs of ended jobs that nodes let go of since the last flush."""
        self._release_flush.cancel()
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
            async with self._locks.setdefault(job, asyncio.Lock()):
                try:
                    for node in sorted(let_go & self.catalog.rows.ended_catalogs_sent_to(job)):
                        await self._publish(wire.catalog_topic(job, node), b"", retain=True)
                        cleared.append(node)
                finally:
                    if cleared:
                        self.catalog.rows.ended_catalogs_cleared(job, cleared, time.time())
                released = self.catalog.rows.ended_catalogs_released(job)
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

    # --- landings -------------------------------------------------------------------

    async def flush_landings(self) -> None:
        """Record the landings received since the last flush, ``RECORD_AT_ONCE`` a
        transaction with the event loop's other work between them, then publish the
        catalogs that changed. At 2,048 nodes a tier's 16,384 landings come within a
        second: recorded 0.05 s of them at a time, they held the loop 0.1-0.3 s a batch
        on a busy host, the longest of its stalls (issue 22); each slice's COMMIT runs on a
        worker thread while the loop turns (``Store.batch_async``). Those that come
        meanwhile wait for the next flush. Last, the shard rows of the steps retention
        dropped are deleted, a slice a transaction, committed the same way
        (:meth:`~supervisor.checkpoints.rows.CkptRows.purge_some`)."""
        async with self._flushing:  # one at a time: the landings are recorded in order
            changed = await self._record_flushed()
        if changed is None:
            return
        if changed:
            # A commit's catalogs out, then the cyclic collector: a pass of it in the
            # middle of a 2,048-node build held the event loop 0.3-0.4 s (issue 22).
            held = gcdefer.hold()
            try:
                for job_id in sorted(changed):
                    await self.publish(job_id)
            finally:
                held.release()
        await self._purge_retired()

    async def _record_flushed(self) -> set[str] | None:
        """Record the landings queued, a slice a transaction; the jobs whose catalog
        changed, or None on a store error (the rest stay queued, a retry is timed)."""
        self._landing_flush.cancel()
        batch, self._landings = self._landings, []
        pending = [batch[i : i + RECORD_AT_ONCE] for i in range(0, len(batch), RECORD_AT_ONCE)]
        changed: set[str] = set()
        began = time.time()
        try:
            while pending:
                await self._record_first_async(pending, changed)
        except StoreError:
            self._landing_flush.start(RETRY_S)
            return None
        finally:
            self.recorded.append(
                {
                    "at": round(began, 3),
                    "landings": len(batch),
                    "record_s": round(time.time() - began, 3),
                    "changed": sorted(changed),
                }
            )
        return changed

    async def _purge_retired(self) -> None:
        """Delete the shard rows of the steps retention dropped, ``PURGE_AT_ONCE`` a
        transaction, the event loop turning between. On a store error the rest wait for
        the next flush (the landings' retry starts one)."""
        rows = self.catalog.rows
        while rows.purging:
            try:
                async with self.store.batch_async():  # the loop turns while it commits
                    rows.purge_some()
            except StoreError as exc:
                log.warning("the rows of retired checkpoint steps are deleted later: %s", exc)
                self._landing_flush.start(RETRY_S)
                return

    def record_landings(self) -> set[str]:
        """Record the queued landings in one transaction; the jobs whose catalog changed.

        On a store error the landings go back to the queue (acknowledged to the broker,
        they exist nowhere else) and the error is raised. Any other error is one landing
        the store cannot take (a value past what it holds): that one is logged and
        dropped, and it never holds up the others."""
        batch, self._landings = self._landings, []
        pending: list[list[wire.CkptLanding]] = [batch]
        changed: set[str] = set()
        while pending:
            self._record_first(pending, changed)
        return changed

    def _record_first(self, pending: list[list[wire.CkptLanding]], changed: set[str]) -> None:
        """Record the first of the ``pending`` batches (taken off it) in one transaction,
        adding the jobs whose catalog changed to ``changed``. A batch that fails for any
        reason but the store is split in halves until the landing that fails stands
        alone (a few transactions, never one per landing). On a store error that batch
        and every pending one go back to the queue, first, and the error is raised."""
        chunk = pending.pop(0)
        try:
            with self.store.batch():
                ours = self._count(chunk)
        except Exception as exc:
            self._record_failed(exc, chunk, pending, changed)
            return
        except BaseException:
            self.catalog.forget()  # rolled back, or may be: counted again from the store
            raise
        changed |= ours

    async def _record_first_async(
        self, pending: list[list[wire.CkptLanding]], changed: set[str]
    ) -> None:
        """:meth:`_record_first`, committed on a worker thread (``Store.batch_async``)."""
        chunk = pending.pop(0)
        try:
            async with self.store.batch_async():
                ours = self._count(chunk)
        except Exception as exc:
            self._record_failed(exc, chunk, pending, changed)
            return
        except BaseException:
            # Cancelled (a shutdown's drain that ran out of time): this slice's COMMIT may
            # yet fail, and the slices after it were never recorded. All go back to the
            # queue, first, for close() to record: a landing recorded twice is recorded
            # once (each is an upsert, a commit is made once), one lost is not.
            self.catalog.forget()
            self._landings[:0] = [msg for part in (chunk, *pending) for msg in part]
            pending.clear()
            raise
        changed |= ours

    def _record_failed(
        self,
        exc: Exception,
        chunk: list[wire.CkptLanding],
        pending: list[list[wire.CkptLanding]],
        changed: set[str],
    ) -> None:
        """``chunk``'s transaction failed with ``exc`` (rolled back)."""
        self.catalog.forget()  # what it counted was rolled back with it
        if isinstance(exc, StoreError):
            self._requeue([msg for part in (chunk, *pending) for msg in part], exc)
            pending.clear()
            if changed:  # recorded: their catalogs go out with the retry of catalogs
                self._retry_later(changed)
            raise exc
        if len(chunk) > 1:
            pending[:0] = [chunk[: len(chunk) // 2], chunk[len(chunk) // 2 :]]
            return
        log.error(
            "dropped a checkpoint landing the store cannot take: %r: %s",
            exc,
            chunk[0].model_dump_json()[:500],
        )

    def _count(self, msgs: list[wire.CkptLanding]) -> set[str]:
        """Count ``msgs`` in the catalog, in the caller's transaction; the jobs whose
        catalog changed."""
        ours: set[str] = set()
        for msg in msgs:
            job = self._job(msg.job)
            if job is None:
                log.warning("dropped: a checkpoint landing of unknown job %s", msg.job)
            elif void_landing(job, msg):
                log.info(
                    "job %s: ignored a landing of step %d from generation %d: a rollback voided it",
                    msg.job,
                    msg.step,
                    msg.generation,
                )
            elif self.catalog.on_landing(msg, job.world_size_of(msg.generation)):
                ours.add(msg.job)
        return ours

    def _requeue(self, msgs: list[wire.CkptLanding], exc: StoreError) -> None:
        self._landings[:0] = msgs[-MAX_QUEUED_LANDINGS:]
        lost = len(self._landings) - MAX_QUEUED_LANDINGS
        if lost > 0:
            del self._landings[:lost]
            log.error(
                "dropped the %d oldest checkpoint landings: the store has failed for too long",
                lost,
            )
        log.error("recording %d checkpoint landing(s) failed, trying again: %s", len(msgs), exc)

    # --- shutdown -------------------------------------------------------------------

    def stop(self) -> None:
        """Stop accepting: no batch, retry or linger is timed any more (those pending are
        cancelled) and no task starts; what comes from now on is only queued, for
        :meth:`drain` and :meth:`close`."""
        self._stopped = True
        self.tasks.close()
        for timer in (self._landing_flush, self._release_flush, self._retry):
            timer.close()
        for timer in self._lingers.values():
            timer.close()
        self._lingers.clear()

    async def drain(self, timeout: float) -> None:
        """With the link still up: record the landings received and publish the catalogs
        they changed, then clear the catalogs of the releases received; at most
        ``timeout`` seconds (what is left then is recorded by :meth:`close`, and its
        catalogs go out at the next start)."""
        try:
            async with asyncio.timeout(timeout):
                await self.flush_landings()
                await self.flush_releases()
        except TimeoutError:
            log.warning(
                "checkpoint catalogs: the shutdown's drain did not end within %.1f s", timeout
            )

    async def shutdown(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the publisher's tasks, then cancel the rest."""
        await self.tasks.shutdown(timeout)

    def close(self) -> None:
        """Once the link is closed (nothing comes any more): record the landings that came
        since the drain. Landings the store refuses now are lost, and the log says how
        many."""
        if self._landings:
            try:
                self.record_landings()
            except StoreError as exc:
                log.error(
                    "%d checkpoint landing(s) received before the shutdown are lost: %s",
                    len(self._landings),
                    exc,
                )
