"""The agent's side of the training channel: step reports in, hangs detected, requests out.

Ranks report every step with ``phalanx.rank.step`` (see :mod:`phalanx.progress` for the
datagram): :class:`ProgressMonitor` binds the progress socket beside the agent's rank
socket (mode 0600), records per (job, rank) the last step, when it came, the recent
intervals between steps and the last scalars, and answers a report with the requests
pending for its rank (``save_now``, each delivered once).

Fencing: the monitor follows the generation the agent runs for each job
(:meth:`ProgressMonitor.begin` on a start, :meth:`ProgressMonitor.end` on a stop).
Reports of an older generation are ignored (``fenced``); of a job or generation not
started here, too (``unknown``); datagrams that do not parse are counted
(``garbage``) and dropped.

Hang detection, every :data:`CHECK_INTERVAL_S`: a job generation whose ranks on this
node have reported at least once is hung when none of them has reported a new step
for its hang timeout: ``StartRanksArgs.hang_timeout_s`` when given, else
``max(HANG_FLOOR_S, HANG_STEP_FACTOR x the median interval between steps)``. It then
sends ONE ``RankEvent(event="hung")`` for that generation, naming the likeliest
culprit among this node's ranks: one whose process is stopped (state ``T``/``t``),
else the one furthest behind, else the one silent longest, and listing the
flight-recorder dumps the generation's ranks left. A new generation re-arms the
detection; a stop, or a rank of the generation exiting (its exit event explains what
follows), disarms it.

A rank whose loss guard tripped (``phalanx.guard``) sends a ``guard`` report: it becomes
one ``RankEvent(event="guard")`` per generation and node, the first rank's (the
supervisor rolls the gang back), and disarms the hang detection (the ranks hold until
they are stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import resource
import socket
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from pydantic import ValidationError

from agentd.training_events import digest_event, guard_event
from phalanx import flight, wire
from phalanx.progress import (
    MAX_MESSAGE_BYTES,
    ProgressError,
    Requests,
    StepReport,
    decode_report,
    encode_requests,
)
from phalanx.tasks import Tasks, supervised

log = logging.getLogger(__name__)

# The automatic hang timeout: this many median step intervals without a new step...
HANG_STEP_FACTOR = 10.0
# ... and never less than this: a first step (compilation, warm-up), a restore or a
# checkpoint save can legitimately take a minute without being a hang.
HANG_FLOOR_S = 60.0
CHECK_INTERVAL_S = 0.5  # how often hangs are looked for
INTERVALS_KEPT = 64  # recent step intervals remembered per rank (for the median)
FORGET_AFTER_S = 600.0  # an ended generation with no live rank is forgotten this late
DUMP_PREFIX = "nccl-trace-rank-"  # TORCH_FR_DUMP_TEMP_FILE's file names (agentd.ranks)
# How long a hang's report waits for the ranks' flight-recorder dumps, once asked for
# (phalanx.flight): a rank's library answers within its poll (0.5 s), dumped or not.
FLIGHT_WAIT_S = 3.0
MAX_DUMPS = 64  # as many as a RankEvent carries
READS_PER_WAKEUP = 256  # datagrams read in one go before the loop runs other work
GARBAGE_LOG_EVERY_S = 60.0

Reporter = Callable[[wire.RankEvent], Awaitable[None]]
OnStep = Callable[[StepReport], None]  # a step report of a job's current generation
LiveRanks = Callable[[str, int], dict[int, int]]  # (job, generation) -> {rank: pid}, alive


def socket_beside(rank_socket: Path) -> Path:
    """The progress socket's path: the rank socket's, with the suffix ``.progress``
    (``agent.sock`` -> ``agent.progress``), or a short name in the temp folder when that
    would be too long for a unix socket."""
    path = rank_socket.with_suffix(".progress")
    if len(os.fsencode(path)) <= 107:  # sun_path holds 108 bytes, NUL included
        return path
    import xxhash

    tag = xxhash.xxh64_hexdigest(os.fsencode(rank_socket))[:12]
    return Path(tempfile.gettempdir()) / f"phalanx-{tag}.progress"


def hang_timeout(explicit: float | None, intervals: list[float]) -> float:
    """The hang timeout of a generation: ``explicit`` when set, else the automatic one
    (:data:`HANG_STEP_FACTOR` median intervals, at least :data:`HANG_FLOOR_S`)."""
    if explicit is not None:
        return explicit
    if not intervals:
        return HANG_FLOOR_S
    return max(HANG_FLOOR_S, HANG_STEP_FACTOR * statistics.median(intervals))


@dataclass(frozen=True)
class RankStatus:
    """What the agent knows of one rank's progress (a copy)."""

    rank: int
    pid: int
    step: int
    reported_at: float  # the rank's wall time of its last report
    scalars: dict[str, float]
    reports: int


@dataclass
class _Rank:
    pid: int
    step: int
    reported_at: float
    seen: float  # monotonic, when its last new step arrived
    scalars: dict[str, float]
    reply_to: str | bytes | None
    reports: int = 1
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=INTERVALS_KEPT))


@dataclass
class _Generation:
    job: str
    generation: int
    hang_timeout_s: float | None
    touched: float  # monotonic
    ranks: dict[int, _Rank] = field(default_factory=dict)
    last_progress: float | None = None  # monotonic, the node's last new step
    hung_at: float | None = None  # when the event was last sent (again every timeout)
    ended: bool = False  # stopped, superseded, or a rank exited: no hang detection
    save_now: set[int] = field(default_factory=set)  # ranks yet to be asked
    restored: set[int] = field(default_factory=set)  # ranks whose restore was reported
    waiting: dict[int, int] = field(default_factory=dict)  # rank -> checkpoint waits open
    finished: set[int] = field(default_factory=set)  # ranks past their last step
    guarded: set[int] = field(default_factory=set)  # ranks whose loss guard tripped


class ProgressMonitor:
    """Receives this node's step reports and watches them for hangs (see the module doc).

    ``live(job, generation)`` names the ranks of that generation alive on this node and
    their pids (``RankRunner.pids``); ``report`` takes the ``hung`` events (the agent's
    rank-event outbox); ``on_step`` sees every step report that is not fenced (the
    agent's training metrics, :mod:`agentd.metrics`). An async context manager: the
    socket exists inside the block.
    """

    def __init__(
        self,
        node: str,
        path: Path,
        data_dir: Path,
        report: Reporter,
        live: LiveRanks,
        *,
        check_interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        on_step: OnStep | None = None,
        flight_wait_s: float = FLIGHT_WAIT_S,
    ) -> None:
        self.node = node
        self.flight_wait_s = flight_wait_s
        self.path = path
        self.data_dir = data_dir
        self._report = report
        self._live = live
        self._check_interval_s = check_interval_s
        self._clock = clock
        self._on_step = on_step
        self._gens: dict[tuple[str, int], _Generation] = {}
        self._current: dict[str, int] = {}  # job -> the generation the agent runs
        # (job, rank) -> (generation, pid, reply address): ranks that left a failed
        # generation alive and wait to be resumed (phalanx.rank.run, an in-process restart)
        self._parked: dict[tuple[str, int], tuple[int, int, str | bytes]] = {}
        self._sock: socket.socket | None = None
        self._group: asyncio.TaskGroup | None = None
        self._task: asyncio.Task[None] | None = None
        self.received = 0  # reports recorded
        self.garbage = 0  # datagrams that were not reports
        self.fenced = 0  # reports of an older generation
        self.unknown = 0  # reports of a job or generation not started here
        self.replies_dropped = 0
        self._garbage_logged = -math.inf
        self._told = Tasks(f"progress monitor of {node}")  # first steps, restores told

    # --- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> ProgressMonitor:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        old = os.umask(0o177)  # born 0600: no window where another user can send
        try:
            sock.bind(str(self.path))
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self._sock = sock
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._on_readable)
        try:
            self._group = asyncio.TaskGroup()
            await self._group.__aenter__()
            self._task = self._group.create_task(
                supervised("progress-hangs", self._watch), name="progress-hangs"
            )
        except BaseException:
            self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._task is not None:
                self._task.cancel()
            if self._group is not None:
                await self._group.__aexit__(None, None, None)
            await self._told.shutdown(timeout=1.0)  # a first step or restore being told
        finally:
            self._close()

    def _close(self) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    # --- what the agent tells it ------------------------------------------------------

    def begin(self, job: str, generation: int, hang_timeout_s: float | None = None) -> None:
        """A start of ``job``'s ranks of ``generation``: older reports are fenced from now
        on and hang detection is armed afresh (a repeated start changes nothing)."""
        current = self._current.get(job, 0)
        if generation <= current:
            return
        if (old := self._gens.get((job, current))) is not None:
            old.ended = True
            old.save_now.clear()
        self._current[job] = generation
        self._gens[(job, generation)] = _Generation(
            job, generation, hang_timeout_s, touched=self._clock()
        )

    def end(self, job: str, generation: int) -> None:
        """A stop of ``job`` up to ``generation``: no hang detection for those any more."""
        for (j, g), gen in self._gens.items():
            if j == job and g <= generation:
                gen.ended = True
                gen.save_now.clear()
        if generation > self._current.get(job, 0):  # stopped before it started: fenced too
            self.begin(job, generation)
            self._gens[(job, generation)].ended = True

    @contextlib.contextmanager
    def waiting(self, job: str, rank: int) -> Iterator[None]:
        """A rank of ``job``'s current generation waits for its checkpoints to commit
        (``Checkpointer.wait``, typically after its last step): no step comes meanwhile,
        and that is no hang. The node's idle clock starts again when the wait ends."""
        gen = self._gens.get((job, self._current.get(job, 0)))
        if gen is None:
            yield
            return
        gen.waiting[rank] = gen.waiting.get(rank, 0) + 1
        try:
            yield
        finally:
            gen.waiting[rank] -= 1
            if not gen.waiting[rank]:
                del gen.waiting[rank]
            if gen.last_progress is not None:
                gen.last_progress = self._clock()

    def rank_exited(self, job: str, generation: int, rank: int) -> None:
        """A rank of that generation ended here: its exit event is the news, not a hang of
        the ranks left waiting for it."""
        if (gen := self._gens.get((job, generation))) is not None:
            gen.ended = True
            gen.save_now.discard(rank)
        parked = self._parked.get((job, rank))
        if parked is not None and parked[0] <= generation:
            del self._parked[(job, rank)]

    def request_save(self, job: str, generation: int, ranks: list[int]) -> list[int]:
        """Ask ``ranks`` of ``job`` to checkpoint now, each once, in the reply to its next
        report; returns the ranks asked (none when the generation is not the current,
        running one)."""
        gen = self._gens.get((job, generation))
        if gen is None or gen.ended or self._current.get(job) != generation:
            return []
        # Only ranks that report steps ever hear of it: asking the others would make the
        # supervisor wait its whole grace period for a save that cannot come.
        asked = set(ranks) & set(gen.ranks)
        gen.save_now.update(asked)
        return sorted(asked)

    def last_step(self, job: str, generation: int, rank: int) -> int | None:
        """The step ``rank`` reported last, counting the reports still queued on the socket:
        a rank that exits right after a step is seen to exit (its exit event carries this)
        as soon as, or before, the loop reads its last datagram, and the recovery's
        same-step rule compares these steps."""
        self._on_readable()
        gen = self._gens.get((job, generation))
        r = gen.ranks.get(rank) if gen is not None else None
        return r.step if r is not None else None

    def progress(self, job: str, generation: int) -> dict[int, RankStatus]:
        """What the ranks of that generation reported last, by rank."""
        gen = self._gens.get((job, generation))
        if gen is None:
            return {}
        return {
            n: RankStatus(n, r.pid, r.step, r.reported_at, dict(r.scalars), r.reports)
            for n, r in sorted(gen.ranks.items())
        }

    def timeout_of(self, job: str, generation: int) -> float | None:
        """The hang timeout that applies to that generation now (None: not known here)."""
        gen = self._gens.get((job, generation))
        return None if gen is None else hang_timeout(gen.hang_timeout_s, _intervals(gen))

    # --- reports --------------------------------------------------------------------

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(READS_PER_WAKEUP):
            try:
                data, sender = sock.recvfrom(MAX_MESSAGE_BYTES + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("progress socket %s: %s", self.path, exc)
                return
            try:
                self._on_report(decode_report(data), sender)
            except ProgressError as exc:
                self._on_garbage(exc)

    def _on_garbage(self, exc: ProgressError) -> None:
        self.garbage += 1
        now = self._clock()
        if now - self._garbage_logged >= GARBAGE_LOG_EVERY_S:
            self._garbage_logged = now
            log.warning(
                "progress socket %s: dropped a datagram (%d so far): %s",
                self.path,
                self.garbage,
                exc,
            )

    def parked(self, job: str, rank: int) -> tuple[int, int] | None:
        """``(generation, pid)`` of ``job``'s rank ``rank`` when it waits, parked, to be
        resumed as the next generation's (None: it has not said so)."""
        got = self._parked.get((job, rank))
        return None if got is None else (got[0], got[1])

    def resume(self, job: str, rank: int, order: str) -> bool:
        """Tell the parked rank where its next generation's order is; False when it is
        not parked, or the datagram could not be sent."""
        got = self._parked.get((job, rank))
        if got is None or self._sock is None or not self._reply(got[2], Requests(resume=order)):
            return False
        del self._parked[(job, rank)]
        return True

    def forget_parked(self, job: str, rank: int) -> None:
        self._parked.pop((job, rank), None)

    def _on_report(self, report: StepReport, sender: str | bytes | None) -> None:
        if report.kind == "parked":  # of the generation that failed, so never fenced
            if sender:
                self._parked[(report.job, report.rank)] = (report.generation, report.pid, sender)
            return
        current = self._current.get(report.job)
        if current is None or report.generation > current:
            self.unknown += 1
            return
        if report.generation < current:
            self.fenced += 1
            return
        gen = self._gens.get((report.job, current))
        if gen is None:  # forgotten: its ranks ended long ago
            self.unknown += 1
            return
        now = self._clock()
        gen.touched = now
        if report.kind == "finished":
            gen.finished.add(report.rank)  # past its last step: its silence is no hang
            return
        if report.kind == "guard":
            self._on_guard(gen, report)
            return
        if report.kind == "digest":
            self._on_digest(report)
            return
        if report.kind == "restored":
            if report.rank not in gen.restored:  # once per rank: what the supervisor times
                gen.restored.add(report.rank)
                self._tell(
                    wire.RankEvent(
                        node=self.node,
                        job=report.job,
                        generation=report.generation,
                        rank=report.rank,
                        event="restored",
                        pid=report.pid,
                        step=report.step,
                        took_s=max(0.0, report.scalars.get("took_s", 0.0)),
                        at=report.at,
                    )
                )
            return
        if self._on_step is not None:
            self._on_step(report)
        r = gen.ranks.get(report.rank)
        reply_to = sender or None
        if r is None:
            gen.ranks[report.rank] = _Rank(
                report.pid, report.step, report.at, now, dict(report.scalars), reply_to
            )
            gen.last_progress = now
            self._tell(
                wire.RankEvent(
                    node=self.node,
                    job=report.job,
                    generation=report.generation,
                    rank=report.rank,
                    event="stepped",
                    pid=report.pid,
                    step=report.step,
                    at=report.at,
                )
            )
        else:
            if report.step != r.step:
                r.intervals.append(now - r.seen)
                r.step, r.seen = report.step, now
                gen.last_progress = now
            r.pid, r.reported_at, r.reply_to = report.pid, report.at, reply_to
            r.scalars = dict(report.scalars)
            r.reports += 1
        self.received += 1
        if (
            report.rank in gen.save_now
            and reply_to is not None
            and self._reply(reply_to, Requests(save_now=True))
        ):
            gen.save_now.discard(report.rank)
            log.info(
                "job %s gen %d: asked rank %d to save at step %d",
                report.job,
                report.generation,
                report.rank,
                report.step,
                extra={"job": report.job, "rank": report.rank, "event": "save_now"},
            )

    def _on_guard(self, gen: _Generation, report: StepReport) -> None:
        """A rank's loss guard tripped: told once per generation and node (the others'
        trips say the same: at 8 ranks a node, a 16k-rank gang sends 2k events, not 16k);
        the ranks now hold (their silence is no hang) until the supervisor rolls the gang
        back."""
        told = bool(gen.guarded)
        gen.guarded.add(report.rank)
        gen.ended = True
        if told:
            return
        event = guard_event(self.node, report)
        log.warning(
            "job %s gen %d: rank %d's loss guard tripped at step %d (%s since step %s)",
            report.job,
            report.generation,
            report.rank,
            report.step,
            event.guard,
            event.onset,
            extra={"job": report.job, "rank": report.rank, "event": "guard"},
        )
        self._tell(event)

    def _on_digest(self, report: StepReport) -> None:
        """A rank's parameter digest: to the supervisor, which compares the replicas'."""
        if (event := digest_event(self.node, report)) is not None:
            self._tell(event)

    def _tell(self, event: wire.RankEvent) -> None:
        """Hand a rank's first step or restore to the agent's rank events (from the
        socket's callback, which cannot wait)."""
        self._told.spawn(
            _awaited(self._report(event)), name=f"tell-{event.event}-{event.job}-{event.rank}"
        )

    def _reply(self, to: str | bytes, requests: Requests) -> bool:
        assert self._sock is not None
        try:
            self._sock.sendto(encode_requests(requests), socket.MSG_DONTWAIT, to)
        except OSError as exc:  # the rank's queue is full, or it is gone: next report
            self.replies_dropped += 1
            log.debug("reply to %r not sent: %s", to, exc)
            return False
        return True

    # --- hangs ------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._check_interval_s)
            await self.check()

    async def check(self) -> list[wire.RankEvent]:
        """Look for hung generations once; report and return their events."""
        now = self._clock()
        events = []
        for key, gen in list(self._gens.items()):
            live = self._live(gen.job, gen.generation)
            if gen.ended or self._current.get(gen.job) != gen.generation:
                if not live and now - gen.touched > FORGET_AFTER_S:
                    del self._gens[key]
                continue
            if gen.last_progress is None or not live or gen.waiting or gen.finished:
                continue
            idle = now - gen.last_progress
            timeout = hang_timeout(gen.hang_timeout_s, _intervals(gen))
            if idle < timeout:
                gen.hung_at = None
                continue
            if gen.hung_at is not None and now - gen.hung_at < timeout:
                continue  # told; told again each timeout while it lasts (a report can be lost)
            gen.hung_at = now
            progress_at = gen.last_progress
            event = await self._hung_event(gen, live, idle)
            if (
                gen.ended
                or gen.last_progress != progress_at
                or self._current.get(gen.job) != gen.generation
            ):
                gen.hung_at = None  # it moved on while the dumps were asked for
                continue
            log.warning(
                "job %s gen %d: ranks on this node made no progress for %.1fs; rank "
                "%d is the likeliest culprit: %s",
                gen.job,
                gen.generation,
                idle,
                event.rank,
                event.detail,
                extra={"job": gen.job, "rank": event.rank, "event": "ranks_hung"},
            )
            events.append(event)
            try:
                await self._report(event)
            except Exception:
                log.exception("could not report the hang of job %s gen %d", gen.job, gen.generation)
        return events

    async def _hung_event(
        self, gen: _Generation, live: dict[int, int], idle: float
    ) -> wire.RankEvent:
        pids = {
            rank: {pid} | ({gen.ranks[rank].pid} if rank in gen.ranks else set())
            for rank, pid in live.items()
        }
        folder = self.data_dir / "jobs" / gen.job / f"g{gen.generation}"
        states = await asyncio.to_thread(
            lambda: {p: _proc_state(p) for ps in pids.values() for p in ps}
        )
        stopped = {
            rank: state
            for rank in live
            for p in sorted(pids[rank])
            if (state := states.get(p)) in ("T", "t")
        }
        # The ranks dump their flight recorders, when asked, unless one is stopped: that
        # one is the culprit whatever the dumps say (and it could not answer).
        if not stopped and self.flight_wait_s > 0:
            await _ask_flight(folder, sorted(live), self.flight_wait_s)
        dumps, flight = await _flight(folder)
        now = self._clock()

        def behind(rank: int) -> tuple[int, float]:  # lowest step first, then silent longest
            r = gen.ranks.get(rank)
            return (-1, -1.0) if r is None else (r.step, r.seen)

        pool = sorted(stopped or live, key=lambda n: (behind(n), n))
        culprit = pool[0]
        r = gen.ranks.get(culprit)
        step = r.step if r is not None else None
        at_step = f"since step {step}" if step is not None else "before reporting any step"
        if stopped:
            detail = f"process {live[culprit]} stopped (state {stopped[culprit]}) {at_step}"
        elif step is None:
            detail = f"never reported a step; the others made none for {idle:.1f}s"
        else:
            top = max(x.step for n, x in gen.ranks.items() if n in live)
            if step < top:
                detail = (
                    f"no step for {idle:.1f}s; behind the others at step {step} "
                    f"(the furthest at {top})"
                )
            else:
                detail = (
                    f"no step for {idle:.1f}s; all at step {step}, this rank silent "
                    f"longest ({now - r.seen if r else idle:.1f}s)"
                )
        return wire.RankEvent(
            node=self.node,
            job=gen.job,
            generation=gen.generation,
            rank=culprit,
            event="hung",
            pid=live[culprit],
            step=step,
            stopped=bool(stopped),
            idle_s=round(idle, 3),
            detail=detail,
            dumps=dumps,
            flight=flight,
            at=time.time(),
        )


def _intervals(gen: _Generation) -> list[float]:
    return [i for r in gen.ranks.values() for i in r.intervals]


def _proc_state(pid: int) -> str:
    """A process's state letter from /proc/PID/stat ('' when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0] if fields else ""


def _dumps(folder: Path) -> list[str]:
    try:
        found = [p for p in folder.glob(f"{DUMP_PREFIX}*") if p.is_file()]
    except OSError:
        return []
    return [str(p) for p in sorted(found, key=lambda p: (_dump_rank(p.name) is None, p.name))][
        :MAX_DUMPS
    ]


# torch names a dump TORCH_FR_DUMP_TEMP_FILE + its rank: here nccl-trace-rank-R-R.
_DUMP_NAME = re.compile(rf"^{re.escape(DUMP_PREFIX)}(\d{{1,6}})-(\d{{1,6}})$")


def _dump_rank(name: str) -> int | None:
    match = _DUMP_NAME.match(name)
    if match is None or match.group(1) != match.group(2):
        return None
    rank = int(match.group(1))
    return rank if rank <= wire.MAX_RANK else None


async def _flight(folder: Path) -> tuple[list[str], list[wire.FlightPoint]]:
    """The generation's flight-recorder dumps here, and what they say. The dumps are
    files the ranks wrote: they are read in a child process whose memory and time are
    bounded, never in the agent (a crafted pickle can ask for gigabytes, or hold a
    string that takes hours to build). A dump that cannot be read is logged and left
    out; so are points that are not valid on the wire."""
    dumps = await asyncio.to_thread(_dumps, folder)
    ranked = [(r, d) for d in dumps if (r := _dump_rank(Path(d).name)) is not None]
    if not ranked:
        return dumps, []
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "phalanx.flight",
            *(f"{r}={d}" for r, d in sorted(ranked)),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=_bounded,
        )
    except OSError as exc:
        log.warning("flight recorder: could not read the dumps: %s", exc)
        return dumps, []
    try:
        out, err = await asyncio.wait_for(proc.communicate(), flight.CHILD_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        log.warning("flight recorder: reading the dumps took over %ss", flight.CHILD_TIMEOUT_S)
        return dumps, []
    for line in err.decode(errors="replace").splitlines()[:MAX_DUMPS]:
        log.warning("%s", line[:500])
    points: list[wire.FlightPoint] = []
    try:
        found = json.loads(out.decode() or "[]")
    except ValueError:
        found = None
    if not isinstance(found, list):
        log.warning("flight recorder: the reader failed (exit %s)", proc.returncode)
        return dumps, []
    for item in found:
        try:
            points.append(wire.FlightPoint.model_validate(item))
        except ValidationError as exc:
            log.warning("flight recorder: a point left out: %s", exc.errors()[0]["msg"])
    return dumps, points[: wire.MAX_FLIGHT_POINTS]


def _bounded() -> None:
    """In the dump reader's child: its address space bounded."""
    limit = flight.CHILD_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


async def _ask_flight(folder: Path, ranks: list[int], wait_s: float) -> None:
    """Ask the generation's ranks to dump their flight recorders (``phalanx.rank``
    watches for the request) and wait, at most ``wait_s``, until each answered."""
    request = folder / flight.REQUEST
    try:
        asked_ns = await asyncio.to_thread(_touch, request)
    except OSError as exc:
        log.warning("could not ask the ranks for their flight recorders: %s", exc)
        return
    answers = [folder / f"{flight.ANSWER_PREFIX}{r}" for r in ranks]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(lambda: all(_newer(a, asked_ns) for a in answers)):
            return
        await asyncio.sleep(0.1)


def _touch(path: Path) -> int:
    """Write ``path`` anew; its modification time (ns)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{time.time()}\n")
    os.replace(tmp, path)
    return path.stat().st_mtime_ns


def _newer(path: Path, than_ns: int) -> bool:
    try:
        return path.stat().st_mtime_ns >= than_ns
    except OSError:
        return False


async def _awaited(work: Awaitable[None]) -> None:
    await work
