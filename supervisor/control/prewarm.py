"""Warm interpreters on the hot spares, for the jobs they may take over.

A job's own nodes keep a warm interpreter behind each of its ranks (``agentd.warm``), so
a restart in place costs no launch. A spare has no rank of any job: when a failed node's
ranks move to it, they would be launched cold. So each spare is asked to keep warm
interpreters for the running jobs it may take (``wire.PrewarmArgs``): those with
``restart.warm`` and ``restart.use_spares``, whose ranks per node fit its GPUs (and
whose ``gpu_type``, if any, is its GPUs' model), at most
``JOBS_PER_SPARE`` of them (each costs a spare one interpreter per local rank: a few
hundred MiB of memory each with torch imported), the highest priority first, then the
largest, then the oldest. The order is the start order one of the job's nodes would get,
without its checkpoint plan (no buddy credential leaves for a node that starts no
rank), so the interpreters match the ranks the spare will be told to start; it is
renewed every ``EVERY_S`` and lapses on the spare ``LEASE_S`` after the last one, so
interpreters of a job that ended, or of a spare that left the pool, go by themselves.
A spare that refuses a job's prewarm (its working directory is not there, say) is not
asked again for that job for ``REFUSED_S``.

:func:`plan` decides (pure); :class:`SparePrewarm` sends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

from phalanx import wire
from phalanx.tasks import Tasks
from supervisor.errors import RegistryError
from supervisor.jobs import Job, JobState

log = logging.getLogger(__name__)

JOBS_PER_SPARE = 2
EVERY_S = 60.0  # a spare's prewarm of a job is renewed this often
LEASE_S = 180.0  # and lapses this long after the last one
TIMEOUT_S = 30.0
REFUSED_S = 600.0  # a spare that refused a job's prewarm is asked again this much later


def plan(
    spares: Sequence[str],
    jobs: Iterable[Job],
    gpus: Mapping[str, tuple[int, str | None]],
    *,
    per_spare: int = JOBS_PER_SPARE,
) -> dict[str, list[str]]:
    """For each spare, the ids of the jobs it keeps warm interpreters for. ``gpus``: each
    spare's GPU count and model (0 or absent: not known, every job fits)."""
    candidates = sorted(
        (
            j
            for j in jobs
            if j.state is JobState.RUNNING
            and j.nodes
            and j.spec.restart.warm
            and j.spec.restart.use_spares
        ),
        key=lambda j: (-j.spec.priority, -len(j.nodes), j.submitted_at, j.id),
    )
    out: dict[str, list[str]] = {}
    for spare in spares:
        room, model = gpus.get(spare, (0, None))
        fits: list[str] = []
        for j in candidates:
            if len(fits) == per_spare:
                break
            if j.holds(spare) or (room > 0 and j.spec.ranks_per_node > room):
                continue
            if j.spec.gpu_type is not None and model is not None and model != j.spec.gpu_type:
                continue
            fits.append(j.id)
        if fits:
            out[spare] = fits
    return out


Send = Callable[..., Awaitable[wire.CommandAck]]


class SparePrewarm:
    """Sends each spare its prewarm orders (see the module docstring), renewed every
    ``EVERY_S``. ``start_args(job, node)``: the start order ``node`` of the job gets."""

    def __init__(
        self,
        send: Send,
        tasks: Tasks,
        start_args: Callable[[Job, str], wire.StartRanksArgs],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self._tasks = tasks
        self._start_args = start_args
        self._clock = clock
        self._sent: dict[tuple[str, str], float] = {}  # (spare, job) -> when
        self._refused: dict[tuple[str, str], float] = {}  # (spare, job) -> when

    def tick(
        self,
        spares: Sequence[str],
        jobs: Mapping[str, Job],
        gpus: Mapping[str, tuple[int, str | None]],
    ) -> None:
        now = self._clock()
        wanted = plan(spares, jobs.values(), gpus)
        keys = {(spare, job) for spare, ids in wanted.items() for job in ids}
        for key in [k for k in self._sent if k not in keys]:
            del self._sent[key]  # lapses on the spare by itself
        for key in [k for k in self._refused if now - self._refused[k] >= REFUSED_S]:
            del self._refused[key]
        starts: dict[str, wire.StartRanksArgs] = {}  # one per job
        for spare, job_id in sorted(keys):
            if (spare, job_id) in self._refused:
                continue
            if now - self._sent.get((spare, job_id), -1e9) < EVERY_S:
                continue
            self._sent[(spare, job_id)] = now
            if job_id not in starts:
                job = jobs[job_id]
                starts[job_id] = self._start_args(job, job.nodes[0])
            args = wire.PrewarmArgs(start=starts[job_id], lease_s=LEASE_S)
            self._tasks.spawn(self._quietly(spare, args), name=f"prewarm-{job_id}-{spare}")

    async def _quietly(self, spare: str, args: wire.PrewarmArgs) -> None:
        try:
            ack = await self._send(spare, args, timeout=TIMEOUT_S)
        except (TimeoutError, ConnectionError, RegistryError) as exc:
            log.info("prewarm of %s on spare %s not acknowledged: %s", args.start.job, spare, exc)
            return
        if ack.status is not wire.AckStatus.DONE:
            self._refused[(spare, args.start.job)] = self._clock()
            log.warning(
                "spare %s did not prewarm job %s (asked again in %.0f s): %s",
                spare,
                args.start.job,
                REFUSED_S,
                ack.detail or ack.status.value,
                extra={"node": spare, "job": args.start.job, "event": "prewarm_failed"},
            )
