"""The rank-side API: ``Checkpointer``.

Standalone (``Checkpointer(dir=PATH)``) it runs the tier engine in-process:
RAM slots in ``/dev/shm``, the disk tier under ``PATH``, and an object store
when one is configured. Under Phalanx (no ``dir``) the node's agent owns the
tiers and runs the engine; the rank finds it from its environment and only
copies its state into an agent-owned RAM slot (see ``ckpt.remote``).

    ckpt = Checkpointer(dir="/nvme/ckpt", keep=2, interval="auto", mtbf_s=6 * 3600)
    ckpt.reserve(state)                  # optional: allocate the RAM slots now
    if (found := ckpt.restore()) is not None:
        step, state = found
    for step in range(...):
        ...
        if ckpt.due(step):
            ckpt.save(step, state)       # returns once the state is in RAM
    ckpt.wait()                          # every save committed on every tier
    ckpt.close()
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import xxhash

from ckpt.engine import Engine, EventKind, LocalCatalog, TierEvent
from ckpt.errors import CheckpointError, FormatError, ShardCorrupt, ShardMismatch, TierError
from ckpt.format import ShardPlan, plan, write_into
from ckpt.objects import ObjectStore, ObjectTier, open_store
from ckpt.policy import Interval
from ckpt.ram import HEADER_NBYTES, RamTier, WhenBusy
from ckpt.remote import AgentClient, AgentEnv, AgentError, read_file
from ckpt.tiers import DiskTier, Pacing, ShardKey, Tier, check_job

__all__ = ["Checkpointer"]

log = logging.getLogger(__name__)

TierSpec = str | Tier


class Checkpointer:
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
        if dir is None:
            self._init_agent_mode(when_busy, busy_timeout_s, wait_timeout_s, interval, mtbf_s,
                                  on_event)  # fmt: skip
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
        self.stalls: list[float] = []
        self.skipped: list[int] = []
        self.restored_from: str | None = None
        self._on_event = on_event
        if ram_namespace is None:
            where = xxhash.xxh64_hexdigest(str(self.dir).encode())[:10]
            ram_namespace = f"phalanx-{self.job}-{where}-r{rank}"
        self.ram = RamTier(ram_namespace, job=self.job, directory=ram_dir, slots=ram_slots,
                           keep=ram_slots - 1)  # fmt: skip
        self.tiers = self._build_tiers(tiers, object_store, compression)
        names = [self.ram.name, *(t.name for t in self.tiers)]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        keeps = {n: keep for n in names} if isinstance(keep, int) else dict(keep)
        for name, n in keeps.items():
            if name not in names or n < 1:
                raise ValueError(f"keep[{name!r}]={n}: tiers are {names} and keep must be >= 1")
        self.engine = Engine(
            self.ram, self.tiers, keep=keeps, catalog=LocalCatalog((rank,)), pacing=self.pacing,
            on_event=on_event,
        )  # fmt: skip

    def _init_agent_mode(self, when_busy: WhenBusy, busy_timeout_s: float,
                         wait_timeout_s: float, interval: int | float | str,
                         mtbf_s: float | None,
                         on_event: Callable[[TierEvent], None] | None) -> None:  # fmt: skip
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
        self._on_event = on_event
        hello = self.agent.call("POST", "/v1/ckpt/hello", {"world_size": env.world_size})
        self.tier_names: list[str] = list(hello.get("tiers", []))
        if interval == 1 and hello.get("interval") is not None:  # the job spec's, by default
            interval = hello["interval"]
        self.policy = Interval.of(interval, mtbf_s if mtbf_s is not None else 6 * 3600.0)

    def _build_tiers(
        self, specs: Sequence[TierSpec] | None, store: str | ObjectStore | None,
        compression: str | None,
    ) -> list[Tier]:  # fmt: skip
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
                built.append(ObjectTier(store, compression=compression, pacing=self.pacing))
            elif spec == "ram":
                continue  # always there, always first
            else:
                raise ValueError(f"tier {spec!r} must be 'ram', 'disk', 'object' or a Tier")
        return built

    # ----------------------------------------------------------------- saving

    def reserve(self, state: object) -> None:
        """Allocate and touch the RAM slots for shards the size of ``state``
        now, so that no save (the first included) pays for it."""
        if self.agent is not None:
            nbytes = plan(state, ref=ShardKey(self.job, 0, self.rank).ref()).nbytes
            reply = self.agent.call("POST", "/v1/ckpt/reserve", {"nbytes": nbytes})
            for path in reply["paths"]:
                self.agent.map_slot(path)
            return
        self.ram.reserve(plan(state, ref=ShardKey(self.job, 0, self.rank).ref()).nbytes)

    def save(self, step: int, state: object) -> bool:
        """Copy ``state`` into a RAM slot and return; the engine does the rest.

        Returns ``False`` when the save was skipped (``when_busy="skip"`` and
        every slot still being written down). Raises ``UnsupportedValue`` for a
        state the format cannot hold, ``TimeoutError`` when waiting for a slot
        took longer than ``busy_timeout_s``.
        """
        start = time.perf_counter()
        key = ShardKey(self.job, step, self.rank)
        shard_plan = plan(state, ref=key.ref())
        if self.agent is not None:
            if not self._save_via_agent(key, shard_plan):
                return False
            stall = time.perf_counter() - start
            self.stalls.append(stall)
            self.policy.saved(step, stall)
            return True
        slot = self.ram.acquire(key, shard_plan.nbytes, when_busy=self.when_busy,
                                timeout=self.busy_timeout_s)  # fmt: skip
        if slot is None:
            self.skipped.append(step)
            self.engine.report(TierEvent(
                "skipped", self.ram.name, key, None, shard_plan.nbytes, 0.0,
                "every RAM slot is still being written down (when_busy='skip')",
            ))  # fmt: skip
            return False
        try:
            write_into(shard_plan, slot.view(shard_plan.nbytes))
        except BaseException:
            self.ram.release(slot, keep_content=False)
            raise
        self.engine.submit(slot, key)
        stall = time.perf_counter() - start
        self.stalls.append(stall)
        self.policy.saved(step, stall)
        return True

    def _save_via_agent(self, key: ShardKey, shard_plan: ShardPlan) -> bool:
        assert self.agent is not None
        nbytes = shard_plan.nbytes
        got = self.agent.call("POST", "/v1/ckpt/acquire", {
            "step": key.step, "nbytes": nbytes, "when_busy": self.when_busy,
            "timeout": self.busy_timeout_s}, timeout=self.busy_timeout_s + 30)  # fmt: skip
        if got.get("skipped"):
            self.skipped.append(key.step)
            log.warning("step %d not saved: %s", key.step, got.get("why", "no free RAM slot"))
            return False
        done = {"step": key.step, "slot": got["slot"], "nbytes": nbytes}
        try:
            mm = self.agent.map_slot(got["path"])
            view = memoryview(mm)[HEADER_NBYTES : HEADER_NBYTES + nbytes]
            try:
                write_into(shard_plan, view)
            finally:
                view.release()
        except BaseException:
            with contextlib.suppress(CheckpointError):
                self.agent.call("POST", "/v1/ckpt/submit", {**done, "abort": True})
            raise
        self.agent.call("POST", "/v1/ckpt/submit", done)
        self._last_saved = key.step
        return True

    def due(self, step: int) -> bool:
        """Whether the loop should checkpoint at ``step`` under the policy."""
        return self.policy.due(step)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed on every tier; raises the
        ``TierError`` of a tier that failed (``.tier`` names it)."""
        if self.agent is not None:
            if self._last_saved is None:
                return
            limit = self.wait_timeout_s if timeout is None else timeout
            self.agent.call("POST", "/v1/ckpt/wait", {"step": self._last_saved,
                                                      "timeout": limit}, timeout=limit + 30)
            return
        self.engine.wait(self.wait_timeout_s if timeout is None else timeout)

    @property
    def events(self) -> list[TierEvent]:
        if self.agent is not None:
            return []  # the agent's engine reports them (to the supervisor)
        with self.engine.cond:
            return list(self.engine.events)

    # ----------------------------------------------------------------- restoring

    def restore(self, step: int | None = None) -> tuple[int, Any] | None:
        """``(step, state)`` of the latest committed step (or ``step``), from the
        nearest tier with a verified copy; ``None`` when no tier has one.

        A copy that fails its checksum or does not parse is reported (a
        ``corrupt`` event) and the next tier is tried; with ``step=None`` an
        older step is tried when no tier has a good copy of the newest.
        Nothing is ever unpickled.
        """
        if self.agent is not None:
            return self._restore_via_agent(step)
        tiers: list[Tier] = [self.ram, *self.tiers]
        listed: dict[str, set[int]] = {}
        for tier in tiers:
            try:
                listed[tier.name] = set(tier.steps(self.job))
            except TierError as exc:
                self._report_read_failure(exc, ShardKey(self.job, step or 0, self.rank))
                listed[tier.name] = set()
        candidates = [step] if step is not None else sorted(set().union(*listed.values()),
                                                            reverse=True)  # fmt: skip
        last_error: CheckpointError | None = None
        for s in candidates:
            key = ShardKey(self.job, s, self.rank)
            for tier in tiers:
                if s not in listed[tier.name]:
                    continue
                try:
                    state = self._read(tier, key)
                except (ShardCorrupt, FormatError, ShardMismatch, TierError) as exc:
                    last_error = exc
                    self._report_read_failure(exc, key, tier.name)
                    continue
                if state is not None:
                    self.restored_from = tier.name
                    log.info("restored step %d of %s rank %d from tier %s", s, self.job,
                             self.rank, tier.name)  # fmt: skip
                    return s, state[0]
        if step is not None and last_error is not None:
            raise last_error
        return None

    def _restore_via_agent(self, step: int | None) -> tuple[int, Any] | None:
        assert self.agent is not None
        query: dict[str, Any] = {"job": self.job, "rank": self.rank}
        if step is not None:
            query["step"] = step
        found = self.agent.call("GET", "/v1/ckpt/restore", query=query)
        last_error: CheckpointError | None = None
        for entry in found["steps"]:
            key = ShardKey(self.job, int(entry["step"]), self.rank)
            for where in entry["candidates"]:
                try:
                    state = self._read_via_agent(where, key)
                except (ShardCorrupt, FormatError, ShardMismatch, TierError, AgentError) as exc:
                    last_error = exc
                    log.warning("restore of step %d rank %d from tier %s failed: %s", key.step,
                                self.rank, where["tier"], exc)  # fmt: skip
                    with contextlib.suppress(CheckpointError):
                        self.agent.call("POST", "/v1/ckpt/report", {
                            "step": key.step, "tier": where["tier"], "error": str(exc)})
                    continue
                if state is not None:
                    self.restored_from = str(where["tier"])
                    log.info("restored step %d of %s rank %d from tier %s", key.step, self.job,
                             self.rank, self.restored_from)  # fmt: skip
                    return key.step, state[0]
        if step is not None and last_error is not None:
            raise last_error
        return None

    def _read_via_agent(self, where: dict[str, Any], key: ShardKey) -> tuple[Any] | None:
        from ckpt.format import decode
        from ckpt.ram import read_slot_view

        assert self.agent is not None
        tier, expected, path = str(where["tier"]), where.get("checksum"), where.get("path")
        if path is not None:
            mm = read_file(str(path))
            if mm is None:
                return None
            try:
                if tier == "ram":
                    view = read_slot_view(mm, key.step)
                    if view is None:
                        return None
                    try:
                        state = decode(view, copy=True, expected=expected, ref=key.ref(path))
                    finally:
                        with contextlib.suppress(BufferError):
                            view.release()
                else:
                    state = decode(mm, expected=expected, ref=key.ref(path))
            finally:
                with contextlib.suppress(BufferError):  # tensors still view a disk map
                    mm.close()
            return (state,)
        data = self.agent.call("GET", "/v1/ckpt/shard", query={
            "job": self.job, "rank": self.rank, "step": key.step, "tier": tier},
            raw=True, timeout=self.wait_timeout_s)  # fmt: skip
        if not data:
            return None
        return (decode(bytearray(data), expected=expected, ref=key.ref(f"{tier}:")),)

    def _read(self, tier: Tier, key: ShardKey) -> tuple[Any] | None:
        from ckpt.format import decode

        stored = tier.open(key)
        if stored is None:
            return None
        try:
            state = decode(stored.buffer, copy=stored.reused, expected=stored.expected,
                           ref=key.ref(stored.path))  # fmt: skip
        finally:
            stored.close()
        return (state,)

    def _report_read_failure(self, exc: CheckpointError, key: ShardKey,
                             tier: str | None = None) -> None:  # fmt: skip
        name = tier if tier is not None else getattr(exc, "tier", "?")
        corrupt = isinstance(exc, ShardCorrupt | FormatError | ShardMismatch)
        kind: EventKind = "corrupt" if corrupt else "failed"
        self.engine.report(TierEvent(kind, name, key, exc.path, 0, 0.0, str(exc)))

    # ----------------------------------------------------------------- lifetime

    def close(self, *, timeout: float | None = None) -> None:
        """Finish the write-down, stop the engine, let go of the tiers. The RAM
        slots are removed when the last save is committed at a lower tier (else
        they stay, so a rerun can restore from them). Under Phalanx the agent
        keeps the tiers: this lets go of the slot mappings only."""
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
            log.warning("keeping the RAM tier's segments %s.*: step %d is only in RAM",
                        self.ram.namespace, max(in_ram))  # fmt: skip
            self.ram.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
