"""The rank-side API: ``Checkpointer``.

Standalone (``Checkpointer(dir=PATH)``) it runs the tier engine in-process:
RAM slots in ``/dev/shm``, the disk tier under ``PATH``, and an object store
when one is configured. Under Phalanx (no ``dir``) the node's agent owns the
tiers and runs the engine; the rank finds it from its environment and only
copies its state into an agent-owned RAM slot (see ``ckpt.remote``).

    ckpt = Checkpointer(dir="/nvme/ckpt", keep=2, interval="auto", mtbf_s=6 * 3600)
    if (found := ckpt.restore()) is not None:
        step, state = found              # the RAM slots are allocated behind it
    else:
        ckpt.reserve(state)              # optional: allocate the RAM slots now
    ckpt.attach(optimizer)               # optional: lazy saves (see below)
    for step in range(...):
        ...
        if ckpt.due(step):
            ckpt.save(step, state)       # returns once the state is in RAM (or on its way)
    ckpt.wait()                          # every save committed on every tier
    ckpt.close()

With ``attach(optimizer)`` a save returns once the copy of the optimizer's tensors
(parameters and state) is started, and the optimizer's next step waits for it; the
rest of the state is copied at the call (``ckpt.lazy``). ``fence()`` waits for the copy:
call it before changing saved tensors in place outside the optimizer's step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import xxhash

from ckpt.agent_restore import restore_via_agent
from ckpt.engine import Engine, EventKind, LocalCatalog, TierEvent
from ckpt.errors import (
    AgentError,
    CheckpointError,
    FormatError,
    ShardCorrupt,
    ShardMismatch,
    ShardRef,
    TierError,
    UnsupportedVersion,
)
from ckpt.format import ShardPlan, decode, plan, write_into
from ckpt.lazy import Copy, LazySaves, LazySaving, cuda_device, to_agent, to_engine
from ckpt.objects import ObjectTier
from ckpt.pacing import Pacing
from ckpt.policy import Interval
from ckpt.ram import HEADER_NBYTES, RamTier, WhenBusy
from ckpt.remote import AgentClient, AgentEnv
from ckpt.stores import ObjectStore, open_store
from ckpt.tiers import DiskTier, ShardKey, Tier, check_job

if TYPE_CHECKING:
    from ckpt._tree import Blob

__all__ = ["Checkpointer"]


log = logging.getLogger(__name__)


def _guard_tripped() -> bool:
    """Whether this process's loss guard tripped (``phalanx.rank``, when it is in use)."""
    rank = sys.modules.get("phalanx.rank")
    return rank is not None and rank.tripped() is not None


TierSpec = str | Tier


class Checkpointer(LazySaving):
    """Saves a rank's state to RAM in one copy and lets the engine carry it down.

    * ``tiers``: the tiers below RAM, nearest first, as names (``"disk"``,
      ``"object"``) or ``Tier`` objects (a peer tier, say). Default: disk, and
      the object store when ``object_store`` is set. RAM is always first.
    * ``keep``: committed steps kept per tier (an int for all, or a mapping by
      tier name); the RAM tier keeps ``ram_slots - 1``.
    * ``when_busy``: what ``save`` does when every RAM slot is still being
      written down: ``"wait"`` (up to ``busy_timeout_s``) or ``"skip"`` (the
      save is dropped, ``save`` returns ``False`` and a ``skipped`` event says so).
    * ``object_store``: ``"s3://bucket/prefix"``, a folder (``file:///...``),
      or an ``ObjectStore``; ``compression`` applies to it (zstd by default).
    * ``interval``/``mtbf_s``: the policy ``due`` answers (see ``ckpt.policy``).
    * ``on_event``: called with every ``TierEvent`` (landed, committed, failed,
      corrupt, skipped, deleted), from the engine's threads.

    ``attach(optimizer, ...)`` makes saves lazy; ``fence``, ``detach``, ``copying`` and
    ``fence_waits`` go with it (``ckpt.lazy.LazySaving``). Without it ``save`` copies
    the whole state before it returns.

    Under Phalanx (no ``dir``) the agent owns the tiers: their list, ``keep``, the
    object store, the RAM slots and the pacing come from the job spec and the
    agent's settings, and the agent reports the events to the supervisor (so
    ``on_event`` and ``events`` stay quiet); ``when_busy``, the timeouts and the
    policy apply as here, ``interval`` defaulting to the job spec's.
    """

    def __init__(
        self,
        dir: str | os.PathLike[str] | None = None,
        *,
        job: str = "local",
        rank: int = 0,
        tiers: Sequence[TierSpec] | None = None,
        keep: int | Mapping[str, int] = 2,
        when_busy: WhenBusy = "wait",
        object_store: str | ObjectStore | None = None,
        compression: str | None = "zstd",
        interval: int | float | str = 1,
        mtbf_s: float | None = None,
        ram_slots: int = 2,
        ram_dir: str | os.PathLike[str] = "/dev/shm",
        ram_namespace: str | None = None,
        pacing: Pacing | None = None,
        on_event: Callable[[TierEvent], None] | None = None,
        busy_timeout_s: float = 600.0,
        wait_timeout_s: float = 3600.0,
    ) -> None:
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy={when_busy!r} must be 'wait' or 'skip'")
        self.agent: AgentClient | None = None
        self._last_saved: int | None = None
        self._reserving: threading.Thread | None = None  # see _reserve_behind
        self._reserved_nbytes = 0  # the shard size the RAM slots were last reserved for
        self.lazy = LazySaves(f"ckpt-copy-r{rank}", wait_timeout_s)
        self.closed = False
        if dir is None:
            self._init_agent_mode(
                when_busy, busy_timeout_s, wait_timeout_s, interval, mtbf_s, on_event
            )
            return
        if type(rank) is not int or rank < 0:
            raise ValueError(f"rank={rank!r} must be a non-negative int")
        self.job = check_job(job)
        self.rank = rank
        self.dir = Path(dir).resolve()
        self.when_busy: WhenBusy = when_busy
        self.busy_timeout_s = busy_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.pacing = pacing if pacing is not None else Pacing()
        self.policy = Interval.of(interval, mtbf_s)
        self.lazy.on_wait = self.policy.waited
        self.stalls: list[float] = []
        self.skipped: list[int] = []
        self.restored_from: str | None = None
        self.restored_fresh: list[str] = []  # where restore(into=) made new tensors
        self._on_event = on_event
        if ram_namespace is None:
            where = xxhash.xxh64_hexdigest(str(self.dir).encode())[:10]
            ram_namespace = f"phalanx-{self.job}-{where}-r{rank}"
        self.ram = RamTier(
            ram_namespace, job=self.job, directory=ram_dir, slots=ram_slots, keep=ram_slots - 1
        )
        self.tiers = self._build_tiers(tiers, object_store, compression)
        names = [self.ram.name, *(t.name for t in self.tiers)]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        keeps = {n: keep for n in names} if isinstance(keep, int) else dict(keep)
        for name, n in keeps.items():
            if name not in names or n < 1:
                raise ValueError(f"keep[{name!r}]={n}: tiers are {names} and keep must be >= 1")
        self.engine = Engine(
            self.ram,
            self.tiers,
            keep=keeps,
            catalog=LocalCatalog((rank,)),
            pacing=self.pacing,
            on_event=on_event,
        )

    def _init_agent_mode(
        self,
        when_busy: WhenBusy,
        busy_timeout_s: float,
        wait_timeout_s: float,
        interval: int | float | str,
        mtbf_s: float | None,
        on_event: Callable[[TierEvent], None] | None,
    ) -> None:
        env = AgentEnv.from_environ()
        self.agent = AgentClient(env)
        self.job, self.rank = env.job, env.rank
        self.dir = Path(env.socket).parent
        self.when_busy = when_busy
        self.busy_timeout_s = busy_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.stalls = []
        self.skipped = []
        self.restored_from = None
        self.restored_fresh = []
        self._on_event = on_event
        hello = self.agent.hello()
        self.tier_names: list[str] = list(hello.tiers)
        if interval == 1 and hello.interval is not None:  # the job spec's, by default
            interval = hello.interval
        if mtbf_s is None:  # the fleet's, as the supervisor learned or was told it
            mtbf_s = hello.mtbf_s or 6 * 3600.0
        self.policy = Interval.of(interval, mtbf_s)
        self.lazy = LazySaves(f"ckpt-copy-r{self.rank}", wait_timeout_s)
        self.lazy.on_wait = self.policy.waited

    def _build_tiers(
        self,
        specs: Sequence[TierSpec] | None,
        store: str | ObjectStore | None,
        compression: str | None,
    ) -> list[Tier]:
        if specs is None:
            specs = ["disk", "object"] if store is not None else ["disk"]
        built: list[Tier] = []
        for spec in specs:
            if isinstance(spec, Tier):
                built.append(spec)
            elif spec == "disk":
                built.append(DiskTier(self.dir / "disk", pacing=self.pacing))
            elif spec == "object":
                if store is None:
                    store = str(self.dir / "objects")
                if not isinstance(store, ObjectStore):
                    store = open_store(str(store), pacing=self.pacing)
                built.append(
                    ObjectTier(
                        store,
                        compression=compression,
                        pacing=self.pacing,
                        level=self.pacing.compress_level,
                    )
                )
            elif spec == "ram":
                continue  # always there, always first
            else:
                raise ValueError(f"tier {spec!r} must be 'ram', 'disk', 'object' or a Tier")
        return built

    # ----------------------------------------------------------------- saving

    def reserve(self, state: object) -> None:
        """Allocate and touch the RAM slots for shards the size of ``state``
        now, so that no save (the first included) pays for it. ``restore`` does
        this by itself, in the background, for the size of what it restored, and
        so does a save of a state larger than any before, for the saves after it."""
        nbytes = plan(state, ref=ShardKey(self.job, 0, self.rank).ref()).nbytes
        self._reserve(nbytes)
        self._reserved_nbytes = max(self._reserved_nbytes, nbytes)

    def _reserve(self, nbytes: int) -> None:
        if self.agent is not None:
            for path in self.agent.reserve(nbytes).paths:
                with contextlib.suppress(FileNotFoundError):  # removed since: a save remakes it
                    self.agent.map_slot(path)
            return
        self.ram.reserve(nbytes)

    def _reserve_behind(self, key: ShardKey, state: object) -> None:
        """Reserve slots for the size of ``state``, just restored, behind the restore (see
        ``_reserve_nbytes_behind``): the first save after a restart then copies into
        touched memory, as every later one does."""
        try:
            nbytes = plan(state, ref=key.ref()).nbytes  # the shapes only, here: never raced
        except CheckpointError as exc:
            log.warning("not reserving RAM slots for restored step %d: %s", key.step, exc)
            return
        self._reserve_nbytes_behind(nbytes)

    def _reserve_nbytes_behind(self, nbytes: int) -> None:
        """Reserve slots for shards of ``nbytes`` in a thread of its own, while the training
        loop goes on, rather than have a save hold the loop while fresh memory is faulted
        in (on a VM, 1.6-2.9 s per GiB). A save that comes first waits for the slot being
        allocated, as it would have allocated it."""
        if nbytes <= self._reserved_nbytes or (
            self._reserving is not None and self._reserving.is_alive()
        ):
            return
        self._reserved_nbytes = nbytes  # once: a failure is logged, and saves allocate
        device = cuda_device()  # pinning a slot for DMA there, not on a new thread's GPU 0

        def run() -> None:
            try:
                if device is not None:
                    sys.modules["torch"].cuda.set_device(device)
                self._reserve(nbytes)
            except Exception as exc:
                log.warning(
                    "could not allocate the RAM slots ahead of the next save (it "
                    "allocates its own then): %s",
                    exc,
                )

        self._reserving = threading.Thread(
            target=run, name=f"ckpt-reserve-r{self.rank}", daemon=True
        )
        self._reserving.start()

    def save(self, step: int, state: object) -> bool:
        """Copy ``state`` into a RAM slot and return; the engine does the rest.

        With ``attach`` it returns once the copy is started (see there). Returns
        ``False`` when the save was skipped (``when_busy="skip"`` and every slot
        still being written down, or the rank's loss guard tripped: the weights are
        the spike's, see ``phalanx.rank.tripped``). Raises ``UnsupportedValue`` for a
        state the format cannot hold, ``TimeoutError`` when waiting for a slot took
        longer than ``busy_timeout_s``, and the ``CheckpointError`` of an earlier lazy
        save whose copy failed.
        """
        if _guard_tripped():
            if not self.skipped or self.skipped[-1] != step:
                log.warning("checkpoint of step %d not saved: the loss guard tripped", step)
            self.skipped.append(step)
            return False
        start = time.perf_counter()
        self.lazy.copier.check()
        key = ShardKey(self.job, step, self.rank)
        shard_plan = plan(state, ref=key.ref())
        if self.agent is not None:
            if not self._save_via_agent(key, shard_plan):
                return False
            self._saved(step, start, shard_plan.nbytes)
            return True
        slot = self.ram.acquire(
            key, shard_plan.nbytes, when_busy=self.when_busy, timeout=self.busy_timeout_s
        )
        if slot is None:
            self.skipped.append(step)
            self.engine.report(
                TierEvent(
                    "skipped",
                    self.ram.name,
                    key,
                    None,
                    shard_plan.nbytes,
                    0.0,
                    "every RAM slot is still being written down (when_busy='skip')",
                )
            )
            return False
        view = slot.view(shard_plan.nbytes)
        try:
            deferred = self._write(shard_plan, view)
        except BaseException:
            view.release()
            self.ram.release(slot, keep_content=False)
            raise
        if deferred:
            finish = to_engine(self.ram, self.engine, slot, key)
            self.lazy.copier.start(Copy(key, deferred, view, len(shard_plan.head), finish))
        else:
            view.release()
            self.engine.submit(slot, key)
        self._saved(step, start, shard_plan.nbytes)
        return True

    def _write(self, shard_plan: ShardPlan, view: memoryview) -> list[Blob]:
        """Lay the shard into ``view``; with optimizers attached, all but their tensors
        (returned: the copier copies them)."""
        if not self.lazy.attached:
            write_into(shard_plan, view)
            return []
        return write_into(shard_plan, view, defer=self.lazy.defer())

    def _saved(self, step: int, start: float, nbytes: int) -> None:
        stall = time.perf_counter() - start
        self.stalls.append(stall)
        self.policy.saved(step, stall)
        self._reserve_nbytes_behind(nbytes)  # the next saves' slots

    def _save_via_agent(self, key: ShardKey, shard_plan: ShardPlan) -> bool:
        assert self.agent is not None
        nbytes = shard_plan.nbytes
        got = self.agent.acquire(
            key.step, nbytes, when_busy=self.when_busy, timeout=self.busy_timeout_s
        )
        if got.skipped or got.slot is None or got.path is None:
            self.skipped.append(key.step)
            log.warning("step %d not saved: %s", key.step, got.why or "no free RAM slot")
            return False
        slot, agent = got.slot, self.agent
        try:
            mm = agent.map_slot(got.path)
            view = memoryview(mm)[HEADER_NBYTES : HEADER_NBYTES + nbytes]
            try:
                deferred = self._write(shard_plan, view)
            except BaseException:
                view.release()
                raise
        except BaseException:
            with contextlib.suppress(CheckpointError):
                agent.submit(key.step, slot, nbytes, abort=True)
            raise
        self._last_saved = key.step
        if deferred:
            finish = to_agent(agent, key.step, slot, nbytes)
            self.lazy.copier.start(Copy(key, deferred, view, len(shard_plan.head), finish))
        else:
            view.release()
            agent.submit(key.step, slot, nbytes)
        return True

    def due(self, step: int) -> bool:
        """Whether the loop should checkpoint at ``step`` under the policy."""
        return self.policy.due(step)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed on every tier; raises the
        ``TierError`` of a tier that failed (``.tier`` names it)."""
        self.lazy.copier.drain(self.wait_timeout_s if timeout is None else timeout)
        if self.agent is not None:
            if self._last_saved is None:
                return
            self.agent.wait(self._last_saved, self.wait_timeout_s if timeout is None else timeout)
            return
        self.engine.wait(self.wait_timeout_s if timeout is None else timeout)

    @property
    def events(self) -> list[TierEvent]:
        if self.agent is not None:
            return []  # the agent's engine reports them (to the supervisor)
        with self.engine.cond:
            return list(self.engine.events)

    # ----------------------------------------------------------------- restoring

    def restore(self, step: int | None = None, *, into: object = None) -> tuple[int, Any] | None:
        """``(step, state)`` of the latest committed step (or ``step``), from the
        nearest tier with a verified copy; ``None`` when no tier has one.

        A copy that fails its checksum or does not parse is reported (a
        ``corrupt`` event) and the next tier is tried; with ``step=None`` an
        older step is tried when no tier has a good copy of the newest.
        Nothing is ever unpickled.

        Under Phalanx the step (``step=None``) is the one the whole gang restores
        from, which the supervisor picks; a bad copy is reported to it and the
        next tier tried, but a rank with no good copy of that step raises a
        ``CheckpointError`` (naming the step and the tiers tried) rather than
        restore an older step than its peers; so does a job whose committed
        steps no rank set can read whole (the error says which rank lacks what).

        ``into``: a state of the same structure, such as the live
        ``{"model": model.state_dict(), "optimizer": opt.state_dict()}``. Each
        saved tensor whose place there holds a tensor of the same type, dtype
        and shape is copied into it (a RAM restore is then one copy into memory
        already touched, or one host-to-device copy for a GPU tensor) and the
        returned state holds that tensor; any other comes back as a new tensor,
        and its place is listed in ``restored_fresh`` (and logged). ``into`` is
        written only from a copy that verified and decoded whole.
        """
        self.restored_fresh = []
        self.lazy.copier.drain(self.wait_timeout_s)  # ``into`` is written in place
        if self.agent is not None:
            t0 = time.perf_counter()
            got = restore_via_agent(
                self.agent, self.job, self.rank, step, into, timeout_s=self.wait_timeout_s
            )
            if got is None:
                return None
            self.restored_from, self.restored_fresh = got.tier, got.fresh
            log.info(
                "restored step %d of %s rank %d from tier %s",
                *(got.step, self.job, self.rank, got.tier),
            )
            self._note_fresh(into, got.step)
            self._reserve_behind(ShardKey(self.job, got.step, self.rank), got.state)
            import phalanx.rank  # the agent times the gang's restore with it

            phalanx.rank.restored(got.step, time.perf_counter() - t0)
            return got.step, got.state
        tiers: list[Tier] = [self.ram, *self.tiers]
        listed: dict[str, set[int]] = {}
        for tier in tiers:
            try:
                listed[tier.name] = set(tier.steps(self.job))
            except TierError as exc:
                self._report_read_failure(exc, ShardKey(self.job, step or 0, self.rank))
                listed[tier.name] = set()
        candidates = (
            [step] if step is not None else sorted(set().union(*listed.values()), reverse=True)
        )
        last_error: CheckpointError | None = None
        for s in candidates:
            key = ShardKey(self.job, s, self.rank)
            for tier in tiers:
                if s not in listed[tier.name]:
                    continue
                try:
                    state = self._read(tier, key, into)
                except (ShardCorrupt, FormatError, ShardMismatch, TierError) as exc:
                    last_error = exc
                    self._report_read_failure(exc, key, tier.name)
                    continue
                if state is not None:
                    self.restored_from = tier.name
                    log.info(
                        "restored step %d of %s rank %d from tier %s",
                        s,
                        self.job,
                        self.rank,
                        tier.name,
                    )
                    self._note_fresh(into, s)
                    self._reserve_behind(key, state[0])
                    return s, state[0]
        if step is not None and last_error is not None:
            raise last_error
        return None

    def saved_layout(self) -> tuple[int, int] | None:
        """``(step, saved world size)``: the step the whole gang restores and how many
        ranks saved it; None when the job has nothing to restore. A job whose ranks
        reshard their state (``elastic.reshard``) compares that size with its own: where
        they differ, each rank reads the saved shards its part of the state overlaps
        (:meth:`restore_shards`, given this step). Under Phalanx only (the agent's
        catalog knows it)."""
        agent = self._agent_only("saved_layout")
        found = agent.restore_plan(None)
        if found.unavailable:
            raise CheckpointError(
                f"no checkpoint to restore from: {found.unavailable}",
                ref=ShardRef(job=self.job, rank=self.rank),
            )
        if not found.steps:
            return None
        step = found.steps[0]
        if step.world_size is None:
            raise AgentError(
                "the agent's restore plan does not say how many ranks saved step "
                f"{step.step}: its agent is older than this rank's library (upgrade the "
                "agents before running a job with elastic.reshard)",
                ref=ShardRef(job=self.job, rank=self.rank),
            )
        return step.step, step.world_size

    def restore_shards(
        self, ranks: Sequence[int], step: int | None = None
    ) -> tuple[int, dict[int, Any]] | None:
        """``(step, {saved rank: its state})``: the shards the saved ranks ``ranks`` wrote
        of the step the whole gang restores, each from the nearest tier with a verified
        copy (another rank's copy at the peer or object tier is streamed through the
        agent, not staged); None when the job has nothing to restore.

        For a job whose ranks reshard their own sharded state (``elastic.reshard``):
        after a shrink or a grow, rank ``r`` of the new gang reads the saved shards its
        part overlaps and builds its part from them. Pass ``step`` from
        :meth:`saved_layout` (the layout it computed ``ranks`` from): each node's catalog
        lists every saved shard of the gang's restore step only, and a step that changed
        meanwhile is an error, never another layout read. A shard that no tier has whole
        raises ``CheckpointError`` naming it, as :meth:`restore` does. Under Phalanx
        only."""
        agent = self._agent_only("restore_shards")
        wanted = sorted(set(ranks))
        if not wanted:
            raise ValueError("restore_shards needs at least one saved rank")
        t0 = time.perf_counter()
        found = agent.restore_plan(None)
        if found.unavailable:
            raise CheckpointError(
                f"no checkpoint to restore rank {self.rank} from: {found.unavailable}",
                ref=ShardRef(job=self.job, rank=self.rank),
            )
        if not found.steps:
            return None
        chosen = found.steps[0].step
        saved = found.steps[0].world_size
        if step is not None and chosen != step:
            raise CheckpointError(
                f"the gang restores step {chosen} now, not step {step}: ask saved_layout() again",
                ref=ShardRef(job=self.job, rank=self.rank),
            )
        bad = [k for k in wanted if k < 0 or (saved is not None and k >= saved)]
        if bad:
            saved_by = f"ranks 0 to {saved - 1}" if saved is not None else "an unknown number"
            raise ValueError(
                f"saved rank(s) {', '.join(map(str, bad))} of step {chosen}: it was saved "
                f"by {saved_by}"
            )
        self.lazy.copier.drain(self.wait_timeout_s)
        states: dict[int, Any] = {}
        tiers: set[str] = set()
        for k in wanted:
            got = restore_via_agent(
                agent.as_rank(k),
                self.job,
                k,
                chosen,
                timeout_s=self.wait_timeout_s,
                stage=k == self.rank,  # never stage another rank's copy in its slots
                exact=True,
            )
            if got is None:  # committed meanwhile gone: the gang's step is the agent's
                raise CheckpointError(
                    f"saved rank {k}'s shard of step {chosen} is no longer committed",
                    ref=ShardRef(job=self.job, rank=k),
                )
            states[k] = got.state
            tiers.add(got.tier)
        self.restored_from = ",".join(sorted(tiers))
        self.restored_fresh = []
        log.info(
            "restored step %d of %s rank %d from the shards of saved rank(s) %s (%s)",
            *(chosen, self.job, self.rank, ",".join(map(str, wanted)), self.restored_from),
        )
        import phalanx.rank  # the agent times the gang's restore with it

        phalanx.rank.restored(chosen, time.perf_counter() - t0)
        return chosen, states

    def _agent_only(self, what: str) -> AgentClient:
        if self.agent is None:
            raise CheckpointError(
                f"Checkpointer.{what} works under Phalanx only (the agent's catalog knows "
                "which ranks saved a step); this one keeps its own tiers",
                ref=ShardRef(job=self.job, rank=self.rank),
            )
        return self.agent

    def _note_fresh(self, into: object, step: int) -> None:
        if into is not None and self.restored_fresh:
            log.warning(
                "restore of step %d into the given state: %d value(s) had no tensor "
                "of the same type, dtype and shape there and came back new: %s",
                step,
                len(self.restored_fresh),
                ", ".join(self.restored_fresh[:10]),
            )

    def _read(self, tier: Tier, key: ShardKey, into: object = None) -> tuple[Any] | None:

        stored = tier.open(key)
        if stored is None:
            return None
        fresh: list[str] = []
        self.restored_fresh = fresh
        try:
            state = decode(
                stored.buffer,
                copy=stored.reused,
                expected=stored.expected,
                ref=key.ref(stored.path),
                into=into,
                fresh=fresh,
            )
        finally:
            stored.close()
        return (state,)

    def _report_read_failure(
        self, exc: CheckpointError, key: ShardKey, tier: str | None = None
    ) -> None:
        name = tier if tier is not None else getattr(exc, "tier", "?")
        corrupt = isinstance(exc, ShardCorrupt | FormatError | ShardMismatch) and not isinstance(
            exc, UnsupportedVersion
        )  # a newer writer's: not bad
        kind: EventKind = "corrupt" if corrupt else "failed"
        self.engine.report(TierEvent(kind, name, key, exc.path, 0, 0.0, str(exc)))

    # ----------------------------------------------------------------- lifetime

    def close(self, *, timeout: float | None = None) -> None:
        """Finish the write-down, stop the engine, let go of the tiers. The RAM
        slots are removed when the last save is committed at a lower tier (else
        they stay, so a rerun can restore from them). Under Phalanx the agent
        keeps the tiers: this lets go of the slot mappings only. A lazy save's copy
        is finished first, and the optimizers are detached."""
        self.closed = True
        try:
            self.lazy.copier.close(self.wait_timeout_s if timeout is None else timeout)
        except (CheckpointError, TimeoutError) as exc:  # that step is not saved; close on
            log.error("closing after a lazy save that was not saved: %s", exc)
        self.lazy.detach()
        if self._reserving is not None:
            self._reserving.join(self.wait_timeout_s if timeout is None else timeout)
            if self._reserving.is_alive():
                log.warning(
                    "closing while the RAM slots reserved behind a save or restore "
                    "are still being allocated"
                )
        if self.agent is not None:
            self.agent.close()
            return
        self.engine.close(self.wait_timeout_s if timeout is None else timeout)
        in_ram = set(self.ram.steps(self.job))
        lower: set[int] = set()
        for tier in self.tiers:
            try:
                lower.update(tier.steps(self.job))
            except Exception as exc:
                log.warning("listing tier %s: %s", tier.name, exc)
            try:
                tier.close()
            except Exception as exc:
                log.warning("closing tier %s: %s", tier.name, exc)
        if not in_ram or max(in_ram) in lower:
            self.ram.unlink()
        else:
            log.warning(
                "keeping the RAM tier's segments %s.*: step %d is only in RAM",
                self.ram.namespace,
                max(in_ram),
            )
            self.ram.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
