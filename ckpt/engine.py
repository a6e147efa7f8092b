"""The write-down engine: seals each saved shard, then carries it down the tiers.

Two background threads (reniced by ``Pacing.nice``, or ``SCHED_IDLE`` with
``Pacing.idle``; both off by default: see there):

* ``ckpt-seal`` checksums a shard in its RAM slot (``format.seal``, xxh3 at
  memory speed, off the training path) and marks the slot sealed: the step is
  then committed at the RAM tier.
* ``ckpt-write`` takes sealed shards in save order down the configured tiers
  (disk, then object store), each reading straight from the RAM slot, checking
  the bytes it wrote against the seal; only then is the slot released for reuse.

A shard landed at a tier is reported to the ``Catalog``, which says when a step
is complete there (standalone: one rank, so at once; under Phalanx the
supervisor's catalog waits for every rank). The engine then commits the step at
the tier (its manifest is written last) and applies retention: the ``keep``
newest committed steps stay, older ones go, so the previous committed step is
never deleted before a newer one is committed at that tier. A tier that fails
is reported (``TierEvent`` of kind ``failed``, a ``TierError`` from ``wait``);
the shard still goes on to the next tier, and nothing committed is touched.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ckpt.errors import CheckpointError, TierError
from ckpt.format import seal, sealed_digest
from ckpt.pacing import Pacing, place_writer_thread
from ckpt.ram import RamTier, Slot
from ckpt.tiers import ShardKey, Tier, TierManifest

__all__ = ["Catalog", "Engine", "EventKind", "LocalCatalog", "TierEvent"]

log = logging.getLogger(__name__)

EventKind = Literal["sealed", "landed", "committed", "failed", "deleted", "skipped", "corrupt"]


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Something that happened to a shard at a tier; forwarded to ``on_event``."""

    kind: EventKind
    tier: str
    key: ShardKey
    path: str | None = None
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "tier": self.tier,
            "job": self.key.job,
            "step": self.key.step,
            "rank": self.key.rank,
            "path": self.path,
            "nbytes": self.nbytes,
            "seconds": round(self.seconds, 6),
            "error": self.error,
            "at": self.at,
        }


class Catalog(Protocol):
    """Decides when a step is committed at a tier (every rank's shard there)."""

    def landed(self, tier: str, key: ShardKey, checksum: str, nbytes: int) -> TierManifest | None:
        """Record one rank's verified shard at ``tier``; returns the step's
        manifest when this completes it, else ``None``."""
        ...


class LocalCatalog:
    """The standalone catalog: the ranks of this process (usually just one)."""

    def __init__(self, ranks: Sequence[int] = (0,)) -> None:
        self.ranks = frozenset(ranks)
        self.lock = threading.Lock()
        self.pending: dict[tuple[str, str, int], dict[int, tuple[str, int]]] = {}

    def landed(self, tier: str, key: ShardKey, checksum: str, nbytes: int) -> TierManifest | None:
        with self.lock:
            shards = self.pending.setdefault((tier, key.job, key.step), {})
            shards[key.rank] = (checksum, nbytes)
            if set(shards) < self.ranks:
                return None
            del self.pending[(tier, key.job, key.step)]
            return TierManifest(key.job, key.step, dict(shards))


@dataclass(slots=True)
class _Work:
    slot: Slot
    key: ShardKey
    checksum: str = ""


class Engine:
    """Seals and writes down the shards that saves leave in a ``RamTier``."""

    def __init__(
        self,
        ram: RamTier,
        tiers: Sequence[Tier],
        *,
        keep: Mapping[str, int],
        catalog: Catalog | None = None,
        pacing: Pacing | None = None,
        on_event: Callable[[TierEvent], None] | None = None,
    ) -> None:
        self.ram = ram
        self.tiers = list(tiers)
        self.keep = dict(keep)
        self.catalog = catalog if catalog is not None else LocalCatalog()
        self.pacing = pacing if pacing is not None else Pacing()
        self.on_event = on_event
        self.events: list[TierEvent] = []
        self.failures: list[TierError] = []
        self.cond = threading.Condition()
        self.pending = 0
        self.committed: dict[str, set[int]] = {}  # tier -> steps this engine saw committed
        self.sealq: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self.writeq: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(
                target=self._loop, args=(self.sealq, self._seal), name="ckpt-seal", daemon=True
            ),
            threading.Thread(
                target=self._loop,
                args=(self.writeq, self._write_down),
                name="ckpt-write",
                daemon=True,
            ),
        ]
        self.closed = False
        for thread in self.threads:
            thread.start()

    # ----------------------------------------------------------------- reporting

    def report(self, event: TierEvent) -> None:
        with self.cond:
            self.events.append(event)
            del self.events[:-1000]
        level = logging.WARNING if event.kind in ("failed", "corrupt", "skipped") else logging.DEBUG
        log.log(
            level,
            "ckpt %s at %s: step %d rank %d %s",
            event.kind,
            event.tier,
            event.key.step,
            event.key.rank,
            event.error or event.path or "",
            extra={"ckpt_event": event.as_dict()},
        )
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                log.exception("the on_event callback failed")

    def fail(self, error: TierError, key: ShardKey, seconds: float = 0.0) -> None:
        # Kept for wait() without its traceback: the frames would pin the slot's memoryview
        # and a later growth of the slot could not unmap it.
        error = error.with_traceback(None)
        error.__context__ = error.__cause__ = None
        with self.cond:
            self.failures.append(error)
        self.report(TierEvent("failed", error.tier, key, error.path, 0, seconds, str(error)))

    # ----------------------------------------------------------------- the pipeline

    def submit(self, slot: Slot, key: ShardKey) -> None:
        """Hand over a slot that ``write_into`` has filled (still unsealed)."""
        with self.cond:
            if self.closed:
                raise CheckpointError("the checkpoint engine is closed", ref=key.ref())
            self.pending += 1
        self.sealq.put(_Work(slot, key))

    def _loop(self, q: queue.SimpleQueue[_Work | None], step: Callable[[_Work], None]) -> None:
        place_writer_thread(self.pacing)
        while (work := q.get()) is not None:
            try:
                step(work)
            except BaseException as exc:  # a supervised loop: report, free the slot, go on
                log.exception(
                    "ckpt engine %s failed on step %d",
                    threading.current_thread().name,
                    work.key.step,
                )
                error = TierError(f"internal error: {exc!r}", tier="engine", ref=work.key.ref())
                self.fail(error, work.key)
                self._done(work)

    def _seal(self, work: _Work) -> None:
        start = time.monotonic()
        view = work.slot.view()
        work.checksum = seal(view)
        self.ram.sealed(work.slot, sealed_digest(view))
        seconds = time.monotonic() - start
        self.report(
            TierEvent("sealed", self.ram.name, work.key, str(work.slot.path), len(view), seconds)
        )
        self._landed(self.ram, work.key, work.checksum, len(view), str(work.slot.path), seconds)
        if self.tiers:
            self.writeq.put(work)
        else:
            self._done(work)

    def _write_down(self, work: _Work) -> None:
        try:
            view = work.slot.view()
            for tier in self.tiers:
                start = time.monotonic()
                try:
                    path = tier.put(work.key, view, work.checksum)
                except TierError as exc:
                    self.fail(exc, work.key, time.monotonic() - start)
                    continue
                except Exception as exc:
                    error = TierError(
                        f"storing the shard failed: {exc!r}", tier=tier.name, ref=work.key.ref()
                    )
                    self.fail(error, work.key, time.monotonic() - start)
                    continue
                try:
                    self._landed(
                        tier, work.key, work.checksum, len(view), path, time.monotonic() - start
                    )
                except Exception as exc:  # reported, and _done still runs exactly once
                    self.fail(
                        TierError(
                            f"recording the landing failed: {exc!r}",
                            tier=tier.name,
                            ref=work.key.ref(),
                        ),
                        work.key,
                    )
        finally:
            self._done(work)

    def _landed(
        self, tier: Tier, key: ShardKey, checksum: str, nbytes: int, path: str, seconds: float
    ) -> None:
        self.report(TierEvent("landed", tier.name, key, path, nbytes, seconds))
        manifest = self.catalog.landed(tier.name, key, checksum, nbytes)
        if manifest is None:
            return
        try:
            tier.commit(manifest)
        except TierError as exc:
            self.fail(exc, key)
            return
        self.report(TierEvent("committed", tier.name, key, path, nbytes, seconds))
        if tier is not self.ram:
            self._retain(tier, key)

    def commit(
        self,
        tier_name: str,
        manifest: TierManifest,
        rank: int,
        *,
        fleet_committed: Collection[int] = (),
        protect: Collection[int] = (),
    ) -> bool:
        """Commit a step that an outside catalog (the supervisor's) found complete at a
        tier, then apply retention there: the agent's path, where ``Catalog.landed``
        only reports and the commit comes later. False when the tier is not
        configured here. A manifest that could not be written is reported (a
        ``failed`` event) and its ``TierError`` raised to the caller, which writes it
        again later (it is not held for ``wait``: a retry may well succeed).

        ``fleet_committed``: the steps the catalog holds committed at this tier; they
        count toward ``keep`` even where this tier has no manifest of them yet (a
        step whose manifest write is still queued, or that landed before an agent
        restart), so retention never deletes one of the ``keep`` newest the fleet
        committed. ``protect``: steps never deleted (the step the gang restores
        from)."""
        key = ShardKey(manifest.job, manifest.step, rank)
        tier = next((t for t in [self.ram, *self.tiers] if t.name == tier_name), None)
        if tier is None:
            return False
        try:
            tier.commit(manifest)
        except TierError as exc:
            self.report(TierEvent("failed", exc.tier, key, exc.path, 0, 0.0, str(exc)))
            raise
        self.report(TierEvent("committed", tier.name, key))
        # RAM too: a slot past ``keep`` is freed (unless still busy)
        self._retain(tier, key, fleet_committed, protect)
        return True

    def _retain(
        self,
        tier: Tier,
        key: ShardKey,
        fleet_committed: Collection[int] = (),
        protect: Collection[int] = (),
    ) -> None:
        """Drop steps older than the ``keep`` newest committed ones at ``tier``."""
        keep = self.keep.get(tier.name, 1)
        try:
            seen = self.committed.setdefault(tier.name, set())
            seen.add(key.step)
            committed = tier.steps(key.job)
            if tier is self.ram:
                # Sealed is not committed: in agent mode the fleet commits a step only once
                # every rank has it, so count only the steps committed here.
                committed = sorted(set(committed) & seen)
                self.ram.newest_committed = committed[-1] if committed else None
            if key.step not in committed:
                return  # only a fresh commit at this tier may retire older steps
            # Fleet steps newer than this one are not committed here yet: counting them
            # would retire this very step before a newer one is readable at this tier.
            counted = sorted(set(committed) | {s for s in fleet_committed if s <= key.step})
            oldest_kept = counted[-keep:][0]
            for step in tier.landed_steps(key.job):
                if step < oldest_kept and step not in protect:
                    tier.delete(key.job, step)
                    self.report(TierEvent("deleted", tier.name, ShardKey(key.job, step, key.rank)))
        except TierError as exc:
            self.fail(exc, key)

    def _done(self, work: _Work) -> None:
        self.ram.release(work.slot)
        with self.cond:
            self.pending -= 1
            self.cond.notify_all()

    # ----------------------------------------------------------------- control

    def idle(self) -> bool:
        with self.cond:
            return self.pending == 0

    def wait(self, timeout: float) -> None:
        """Block until every submitted shard is through every tier; raise the
        first ``TierError`` since the last ``wait`` (naming its tier)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self.pending} checkpoint(s) still being written down after {timeout:g} s"
                    )
                self.cond.wait(left)
            failures, self.failures = self.failures, []
        if failures:
            first = failures[0]
            if len(failures) > 1:
                log.warning(
                    "%d more tier failures since the last wait: %s",
                    len(failures) - 1,
                    "; ".join(str(f) for f in failures[1:]),
                )
            raise first

    def forget_failures(self) -> list[TierError]:
        """Drop the failures no ``wait`` collected (a newer generation of the job starts:
        an older one's failed write-down, say to a buddy that died, is not its own; each
        was reported as a ``failed`` event already). Returns them."""
        with self.cond:
            dropped, self.failures = self.failures, []
        return dropped

    def close(self, timeout: float) -> None:
        """Finish the queued work (up to ``timeout``), then stop the threads."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
        try:
            self.wait(timeout)
        except TierError as exc:  # already reported as a "failed" event
            log.warning("closing with a tier failure not collected by wait(): %s", exc)
        except TimeoutError as exc:  # the threads stop anyway; what was not written is lost
            log.error("closing the checkpoint engine with work still queued: %s", exc)
        finally:
            self.sealq.put(None)
            self.writeq.put(None)
            for thread in self.threads:
                thread.join(timeout)
