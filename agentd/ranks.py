"""The rank runner: starts a job's local rank processes and reports how they end.

Each rank is a child process in its own session (so a stop kills its whole
tree), with the torch.distributed environment (and the agent's own, less its
settings and object-store credentials: ``AGENT_ONLY_ENV``) and its output in a per-rank
log file under ``DATA_DIR/jobs/JOB/gGEN/rank-N.log``, and the progress socket its
``phalanx.rank.step`` reports to (``PHALANX_PROGRESS_SOCKET``). Commands are fenced by
generation: a start for an older generation than one already started is
refused, a stop for generation G stops every generation up to G, and a start
of generation G first stops what still runs of the generations before it.

A job whose start carries a ``warm`` plan keeps warm interpreters (``agentd.warm``)
behind its ranks: a start hands each slot's rank to the slot's ready one, when there
is one, instead of launching a process; the rank is then watched, logged, stopped and
reported exactly as a process launched cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentd.commands import CommandError
from agentd.config import ENV_PREFIX
from agentd.progress import socket_beside
from agentd.warm import Cold, Template, WarmPool, refill_at_once, template_for
from phalanx import wire
from phalanx.tasks import Tasks

log = logging.getLogger(__name__)

# How long a stop waits for ranks to exit after their SIGKILL before it returns without them
# (a process stuck in the kernel); its watcher still reports it when it goes.
KILL_WAIT_S = 10.0

# The agent's credentials for the object store (the Ansible role's EnvironmentFile), and
# the CLI's API token where the agent was started from an operator's shell (a local
# fleet): the ranks never see them, nor the agent's own settings (ENV_PREFIX: the broker
# password among them), unless ranks.pass_env names one. A job that needs cloud
# credentials gets them through its spec's env (from_file).
AGENT_ONLY_ENV = frozenset(
    {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "PHALANX_TOKEN"}
)

# Make a hung NCCL collective fail fast and leave a flight-recorder dump; the buffer is
# gloo's flight recorder's too (phalanx.flight: a hang's culprit from the dumps).
NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_BUFFER_SIZE": "20000",
}


@dataclass
class Rank:
    job: str
    generation: int
    slot: wire.RankSlot
    proc: asyncio.subprocess.Process
    log_path: Path
    started_at: float
    warm: bool = False  # a warm interpreter became it (no process was launched)
    visible: str = ""  # its CUDA_VISIBLE_DEVICES (an in-process restart keeps it)
    code: int | None = None
    signal: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


Reporter = Callable[[wire.RankEvent], Awaitable[None]]
# How long an in-process start waits for a live rank of the older generation to park
# (phalanx.rank.run) before it stops it and starts the slot's rank as usual.
PARK_WAIT_S = 3.0
# The grace a start gives the job's older ranks it finds still running (the supervisor's
# recovery stop gives as much: supervisor.recovery.executor.STOP_GRACE_S).
OLDER_STOP_GRACE_S = 5.0


class Parking(Protocol):
    """The ranks parked for an in-process restart (``agentd.progress.ProgressMonitor``)."""

    def parked(self, job: str, rank: int) -> tuple[int, int] | None: ...

    def resume(self, job: str, rank: int, order: str) -> bool: ...


StepLookup = Callable[[str, int, int], int | None]  # (job, generation, rank) -> last step


class RankRunner:
    def __init__(
        self,
        node: str,
        data_dir: Path,
        socket_path: Path,
        report: Reporter,
        gpus: list[int] | None = None,
        not_on_cpus: set[int] | None = None,
        *,
        progress_socket: Path | None = None,
        last_step: StepLookup | None = None,
        socket_ifname: str | None = None,
        pass_env: Collection[str] = (),
    ) -> None:
        """``progress_socket``: where ranks report steps (default: beside ``socket_path``);
        ``last_step``: the step a rank reported last, for its exit event;
        ``socket_ifname``: the interface of the agent's advertised address, given to the
        ranks as ``GLOO_SOCKET_IFNAME`` unless the job or the host sets it;
        ``pass_env``: the agent's own variables its ranks get all the same
        (``ranks.pass_env``)."""
        self.node = node
        self.pass_env = frozenset(pass_env)
        self.socket_ifname = socket_ifname
        self.gpus = list(gpus or [])
        # The CPUs the ranks run on: all this agent may use but those kept for its
        # checkpoint write-down (ckpt.write_cpus); None: no restriction.
        self.cpus: set[int] | None = None
        if not_on_cpus and (others := os.sched_getaffinity(0) - not_on_cpus):
            self.cpus = others
        self.data_dir = data_dir
        self.socket_path = socket_path
        self.progress_socket = progress_socket or socket_beside(socket_path)
        self._last_step = last_step
        self._report = report
        self._ranks: dict[tuple[str, int], Rank] = {}  # (job, rank) -> current process
        self._generation: dict[str, int] = {}  # job -> highest generation started
        self._watchers = Tasks(f"rank watchers of {node}")  # one per rank process
        # GPUs each job holds, claimed synchronously when its start is accepted, so two
        # starts racing through the awaits below can never be handed the same GPU.
        self._claims: dict[str, tuple[int, set[int]]] = {}  # job -> (generation, gpus)
        self._locks: dict[str, asyncio.Lock] = {}
        self.closing = False  # set when the agent stops: no new start is accepted
        self.warm = WarmPool(
            node, data_dir, on_spawn=self._keep_off_write_cpus if self.cpus is not None else None
        )
        self.parking: Parking | None = None  # set by the agent: in-process restarts

    # --- queries -----------------------------------------------------------

    def running(self) -> list[wire.JobRanks]:
        jobs: dict[tuple[str, int], list[int]] = {}
        for r in self._ranks.values():
            if not r.done.is_set():
                jobs.setdefault((r.job, r.generation), []).append(r.slot.rank)
        return [
            wire.JobRanks(job=j, generation=g, ranks=sorted(ranks))
            for (j, g), ranks in sorted(jobs.items())
        ]

    def pids(self, job: str, generation: int) -> dict[int, int]:
        """The live ranks of that job generation here, and their pids."""
        return {
            r.slot.rank: r.proc.pid
            for r in self._ranks.values()
            if r.job == job and r.generation == generation and not r.done.is_set()
        }

    def log_path(self, job: str, rank: int) -> Path | None:
        r = self._ranks.get((job, rank))
        if r is not None:
            return r.log_path
        found = sorted(
            (self.data_dir / "jobs" / job).glob(f"g*/rank-{rank}.log"),
            key=lambda p: int(p.parent.name[1:]),
        )
        return found[-1] if found else None

    # --- commands ------------------------------------------------------------

    @staticmethod
    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def _lock(self, job: str) -> asyncio.Lock:
        return self._locks.setdefault(job, asyncio.Lock())

    async def start(self, req: wire.StartRanksArgs) -> dict[str, Any]:
        # Start and stop of one job are serialised: a stop arriving while a start is still
        # spawning must find (and kill) every rank that start launches.
        async with self._lock(req.job):
            self.warm.cancel_idle(req.job)  # a lease lapsing now would fence them out
            try:
                return await self._start(req)
            finally:
                if self.warm.pids(req.job) and not self._has_ranks(req.job):
                    # Nothing started (refused, or no process would start): they go
                    # once idle, as after the job's last rank here.
                    self.warm.discard_when_idle(req.job, lambda: self._has_ranks(req.job))

    async def _start(self, req: wire.StartRanksArgs) -> dict[str, Any]:
        if self.closing:
            raise CommandError(
                f"job {req.job}: agent on node {self.node} is stopping; no new ranks"
            )
        current = self._generation.get(req.job, 0)
        if req.generation < current:
            raise CommandError(
                f"job {req.job}: generation {req.generation} is older than "
                f"generation {current} already started here; refused"
            )
        if req.generation == current:  # a redelivered or repeated start: report, don't rerun
            pids = {
                r.slot.rank: r.proc.pid
                for r in self._ranks.values()
                if r.job == req.job and r.generation == current
            }
            return {"pids": pids, "already_started": True}
        workdir = Path(req.workdir)
        if not await asyncio.to_thread(workdir.is_dir):
            raise CommandError(
                f"job {req.job}: workdir {req.workdir} does not exist on node {self.node}"
            )
        env = self._environment(req)
        slots = self._assign_gpus(req)
        try:
            return await self._launch(req, slots, env, workdir)
        finally:
            self._release_if_idle(req.job, req.generation)  # nothing started: free the GPUs

    async def _launch(
        self,
        req: wire.StartRanksArgs,
        slots: list[wire.RankSlot],
        env: dict[str, str],
        workdir: Path,
    ) -> dict[str, Any]:
        self._generation[req.job] = req.generation
        self.warm.drop_prewarmed(keep=req.job)
        logs = self.data_dir / "jobs" / req.job / f"g{req.generation}"
        logs.mkdir(parents=True, exist_ok=True)
        visible = ",".join(str(s.gpu) for s in slots if s.gpu is not None)
        adopted: dict[int, int] = {}
        if req.in_process:
            adopted = await self._adopt(req, slots, env, logs, visible)
        # Ranks of an older generation whose stop never arrived, or is still on its way (a
        # recovery relaunches without every stop's ack), go first: left running, they would
        # hold the GPUs and, replaced in self._ranks, escape every later stop. They get the
        # supervisor's own short recovery grace: this start's acknowledgement waits for them.
        grace = min(req.grace_s, OLDER_STOP_GRACE_S)
        await self._stop(req.job, req.generation - 1, grace_s=grace)
        pids = dict(adopted)
        cold: dict[int, str] = {}  # rank -> why no warm interpreter became it
        templates: dict[int, Template] = {}
        for slot in slots:
            rank_env = _rank_env(env, slot, logs, visible)
            log_path = logs / f"rank-{slot.rank}.log"
            template = template_for(req, workdir, rank_env)
            if template is not None:
                templates[slot.local_rank] = template
            if slot.rank in adopted:
                continue
            started = await self.warm.start_rank(req, slot, template, rank_env, workdir, log_path)
            if not isinstance(started, Cold):
                rank = Rank(
                    req.job,
                    req.generation,
                    slot,
                    started,
                    log_path,
                    time.time(),
                    warm=True,
                    visible=visible,
                )
                self._started(rank)
                pids[slot.rank] = started.pid
                continue
            cold[slot.rank] = started.reason
            with log_path.open("ab") as out:
                try:
                    proc = await asyncio.create_subprocess_exec(
                        *req.command,
                        cwd=workdir,
                        env=rank_env,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=out,
                        stderr=asyncio.subprocess.STDOUT,
                        start_new_session=True,
                    )
                except OSError as exc:
                    await self._stop(req.job, req.generation, grace_s=5.0)
                    raise CommandError(
                        f"job {req.job}: cannot start {req.command[0]!r} on "
                        f"node {self.node}: {exc.strerror or exc}"
                    ) from exc
            if self.cpus is not None:
                self._keep_off_write_cpus(proc.pid)
            self._started(
                Rank(req.job, req.generation, slot, proc, log_path, time.time(), visible=visible)
            )
            pids[slot.rank] = proc.pid
        if templates:
            ranks = [s.rank for s in slots]
            at_once = refill_at_once(len(self.cpus or os.sched_getaffinity(0)), len(ranks))
            self.warm.refill(
                req.job,
                templates,
                None if at_once else lambda: self._settled(req.job, req.generation, ranks),
            )
        else:
            self.warm.discard(req.job)
        answer: dict[str, Any] = {
            "pids": pids,
            "cold": {str(r): why for r, why in sorted(cold.items())},
        }
        if req.in_process:
            answer["resumed"] = sorted(adopted)
        return answer

    async def _adopt(
        self,
        req: wire.StartRanksArgs,
        slots: list[wire.RankSlot],
        env: dict[str, str],
        logs: Path,
        visible: str,
    ) -> dict[int, int]:
        """An in-process start: each live rank of the job's older generation here that
        parked (``phalanx.rank.run``) becomes its slot's rank of this generation, in its
        own process: its order (environment, log) goes in a file only the agent's user
        reads, and the rank is told where. Waits up to ``PARK_WAIT_S`` for ranks still on
        their way to park; returns rank -> pid of those resumed."""
        parking = self.parking
        if parking is None:
            return {}
        waiting = {
            slot.rank: (slot, r)
            for slot in slots
            if (r := self._ranks.get((req.job, slot.rank))) is not None
            and not r.done.is_set()
            and r.generation < req.generation
        }
        adopted: dict[int, int] = {}
        deadline = time.monotonic() + PARK_WAIT_S
        while waiting:
            for number, (slot, r) in list(waiting.items()):
                found = parking.parked(req.job, number)
                if found is None or found[0] != r.generation or not _in_session(found[1], r):
                    continue
                if (r.slot.gpu, r.slot.local_rank, r.visible) != (
                    slot.gpu,
                    slot.local_rank,
                    visible,
                ):
                    del waiting[number]  # another GPU or slot: it is stopped, and started
                    continue
                rank_env = _rank_env(env, slot, logs, visible)
                log_path = logs / f"rank-{number}.log"
                order = logs / f".resume-rank-{number}.json"
                await asyncio.to_thread(
                    _write_private, order, {"env": rank_env, "log": str(log_path)}
                )
                if not parking.resume(req.job, number, str(order)):
                    with contextlib.suppress(OSError):
                        order.unlink()  # it holds the rank's environment, secrets included
                    continue
                del waiting[number]
                old = r.generation
                r.generation, r.slot, r.log_path = req.generation, slot, log_path
                r.started_at = time.time()
                adopted[number] = r.proc.pid
                log.info(
                    "job %s gen %d: rank %d resumed in its process (pid %d) from gen %d",
                    req.job,
                    req.generation,
                    number,
                    r.proc.pid,
                    old,
                    extra={"job": req.job, "rank": number, "event": "rank_resumed"},
                )
            if not waiting or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        if adopted:
            self._record()
        return adopted

    async def prewarm(self, args: wire.PrewarmArgs) -> dict[str, Any]:
        """Warm interpreters for a job with no rank here (this node is a hot spare), one
        per local rank slot of ``args.start``, started as its ranks would be; they go
        ``args.lease_s`` after the last prewarm unless a rank of the job runs here."""
        req = args.start
        async with self._lock(req.job):
            if self._has_ranks(req.job):
                return {"warm": 0, "note": "the job runs here: its own ranks keep them warm"}
            workdir = Path(req.workdir)
            if not await asyncio.to_thread(workdir.is_dir):
                raise CommandError(
                    f"job {req.job}: workdir {req.workdir} does not exist on node {self.node}"
                )
            env = self._environment(req)
            logs = self.data_dir / "jobs" / req.job / f"g{req.generation}"
            templates = {
                slot.local_rank: template
                for slot in req.ranks
                if (template := template_for(req, workdir, _rank_env(env, slot, logs, "")))
                is not None
            }
            if not templates:
                return {"warm": 0, "note": "no warm plan, or a command that cannot run warm"}
            lock = self._lock(req.job)
            if not self.warm.prewarm(
                req.job, templates, args.lease_s, lambda: self._has_ranks(req.job) or lock.locked()
            ):
                return {"warm": 0, "note": "this agent keeps no warm interpreters for the job"}
            return {"warm": len(templates)}

    def _has_ranks(self, job: str) -> bool:
        return any(r.job == job and not r.done.is_set() for r in self._ranks.values())

    def _started(self, rank: Rank) -> None:
        self._ranks[(rank.job, rank.slot.rank)] = rank
        self._record()
        self._watchers.spawn(self._watch(rank), name=f"rank-{rank.job}-{rank.slot.rank}")
        log.info(
            "job %s gen %d: started rank %d (pid %d%s)",
            rank.job,
            rank.generation,
            rank.slot.rank,
            rank.proc.pid,
            ", a warm interpreter" if rank.warm else "",
            extra={"job": rank.job, "rank": rank.slot.rank, "event": "rank_started"},
        )

    async def _settled(self, job: str, generation: int, ranks: list[int]) -> None:
        """Return once every rank of that start here reported a step (or ended)."""
        while self._last_step is not None:
            pending = [
                r
                for r in ranks
                if (rank := self._ranks.get((job, r))) is not None
                and rank.generation == generation
                and not rank.done.is_set()
                and self._last_step(job, generation, r) is None
            ]
            if not pending:
                return
            await asyncio.sleep(0.2)

    def _keep_off_write_cpus(self, pid: int) -> None:
        """Put a rank just started on ``self.cpus``: every thread it has (it has only just
        exec'd: a rank's interpreter takes far longer to start threads, importing torch),
        and so every thread and child it makes from now on; it may widen them itself."""
        assert self.cpus is not None
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            threads = [pid]
        for tid in threads:
            try:
                os.sched_setaffinity(tid, self.cpus)
            except OSError as exc:  # gone already (its exit is reported), or refused
                log.warning(
                    "could not keep rank process %d (thread %d) off the write-down CPUs: %s",
                    pid,
                    tid,
                    exc,
                )

    def _assign_gpus(self, req: wire.StartRanksArgs) -> list[wire.RankSlot]:
        """Give each slot a GPU no other job holds, in index order, and claim them."""
        if not req.assign_gpus or not self.gpus:
            return list(req.ranks)
        self._claims.pop(req.job, None)  # a newer generation of the same job re-claims
        busy: set[int] = set()
        for _, gpus in self._claims.values():
            busy |= gpus
        # A rank of this job still alive in a slot keeps its GPU (an in-process restart
        # resumes it there: its CUDA context cannot move).
        keep: dict[int, int] = {}
        if req.in_process:
            for s in req.ranks:
                r = self._ranks.get((req.job, s.rank))
                if (
                    s.gpu is None
                    and r is not None
                    and not r.done.is_set()
                    and r.slot.gpu is not None
                    and r.slot.gpu not in busy
                    and r.slot.gpu not in keep.values()
                ):
                    keep[s.rank] = r.slot.gpu
        free = [g for g in self.gpus if g not in busy and g not in keep.values()]
        wanted = [s for s in req.ranks if s.gpu is None and s.rank not in keep]
        if len(wanted) > len(free):
            raise CommandError(
                f"job {req.job}: node {self.node} has {len(free)} free GPUs, "
                f"{len(wanted)} ranks asked for one each"
            )
        it = iter(free)
        slots = [
            s
            if s.gpu is not None
            else s.model_copy(update={"gpu": keep[s.rank] if s.rank in keep else next(it)})
            for s in req.ranks
        ]
        self._claims[req.job] = (req.generation, {s.gpu for s in slots if s.gpu is not None})
        return slots

    def _release_if_idle(self, job: str, generation: int) -> None:
        """Drop the job's GPU claim once no rank of the claiming generation is alive."""
        claim = self._claims.get(job)
        if claim is None or claim[0] != generation:
            return
        if not any(
            r.job == job and r.generation == generation and not r.done.is_set()
            for r in self._ranks.values()
        ):
            del self._claims[job]

    def _environment(self, req: wire.StartRanksArgs) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if self.passes(k)}
        for key, value in req.env.items():
            if isinstance(value, wire.EnvFromFile):
                env[key] = self._read_secret(req.job, key, value.from_file)
            else:
                env[key] = value
        env.update(NCCL_ENV)
        if self.socket_ifname and "GLOO_SOCKET_IFNAME" not in env:
            # gloo binds to the address its host name resolves to: 127.0.0.1 on hosts
            # whose name is not in DNS, and then no other node reaches the rendezvous.
            env["GLOO_SOCKET_IFNAME"] = self.socket_ifname
        env.update(
            {
                "WORLD_SIZE": str(req.world_size),
                "LOCAL_WORLD_SIZE": str(len(req.ranks)),
                "GROUP_RANK": str(req.group_rank),
                "MASTER_ADDR": req.master_addr,
                "MASTER_PORT": str(req.master_port),
                "PHALANX_JOB_ID": req.job,
                "PHALANX_GENERATION": str(req.generation),
                "PHALANX_NODE": self.node,
                "PHALANX_AGENT_SOCKET": str(self.socket_path),
                "PHALANX_PROGRESS_SOCKET": str(self.progress_socket),
            }
        )
        return env

    def passes(self, name: str) -> bool:
        """Whether the agent's environment variable ``name`` reaches its ranks: all do
        but the agent's own (its settings, ``ENV_PREFIX``, and the object store's
        credentials, ``AGENT_ONLY_ENV``), unless ``pass_env`` names it."""
        if name in self.pass_env:
            return True
        return not name.startswith(ENV_PREFIX) and name not in AGENT_ONLY_ENV

    def _read_secret(self, job: str, key: str, path: str) -> str:
        """The value of env ``key`` from the file ``path``. No error shows any of its bytes:
        a decode error would name one and its offset, so it is not chained either."""
        where = f"job {job}: env {key}: {path} on node {self.node}"
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise CommandError(
                f"job {job}: env {key}: cannot read {path} on node {self.node}: "
                f"{exc.strerror or exc}"
            ) from exc
        try:
            value = raw.decode().strip()
        except UnicodeDecodeError:
            raise CommandError(f"{where} is not UTF-8 text") from None
        if "\0" in value:  # the environment cannot hold it: exec would refuse
            raise CommandError(f"{where} holds a NUL byte")
        return value

    async def stop(
        self, job: str, generation: int, *, grace_s: float, keep_warm: bool = False
    ) -> dict[str, Any]:
        """Stop every rank of ``job`` up to ``generation``; returns once all are gone.
        ``keep_warm``: the job goes on (a recovery), so its warm interpreters stay."""
        async with self._lock(job):
            if not keep_warm:
                self.warm.discard(job)
            return await self._stop(job, generation, grace_s=grace_s)

    async def _stop(self, job: str, generation: int, *, grace_s: float) -> dict[str, Any]:
        victims = [
            r
            for r in self._ranks.values()
            if r.job == job and r.generation <= generation and not r.done.is_set()
        ]
        self._generation[job] = max(self._generation.get(job, 0), generation)
        for r in victims:
            _killpg(r.proc.pid, signal.SIGTERM)
            # A stopped process (SIGSTOP, a debugger let go) gets its SIGTERM only once it
            # runs again; SIGKILL would need no SIGCONT, but the grace is for a clean exit.
            _killpg(r.proc.pid, signal.SIGCONT)
        if victims:
            for r in await _wait_done(victims, grace_s):
                log.warning(
                    "job %s rank %d ignored SIGTERM for %.0fs; SIGKILL", job, r.slot.rank, grace_s
                )
                _killpg(r.proc.pid, signal.SIGKILL)
            for r in await _wait_done(victims, KILL_WAIT_S):
                log.error(
                    "job %s rank %d outlived SIGKILL by %.0f s (pid %d, stuck in the kernel?); "
                    "it is reported when it exits",
                    job,
                    r.slot.rank,
                    KILL_WAIT_S,
                    r.proc.pid,
                )
        return {"stopped": sorted(r.slot.rank for r in victims)}

    async def stop_all(self, grace_s: float) -> None:
        """At shutdown: refuse new starts, stop every rank, and return once each rank's exit
        was reported (or its watcher given up on, ``KILL_WAIT_S`` after the stops)."""
        self.closing = True
        await self.warm.close()
        jobs = {(r.job, r.generation) for r in self._ranks.values() if not r.done.is_set()}
        await asyncio.gather(*(self.stop(j, g, grace_s=grace_s) for j, g in jobs))
        await self._watchers.shutdown(timeout=KILL_WAIT_S)

    # --- orphans ---------------------------------------------------------------

    @property
    def _ledger(self) -> Path:
        return self.data_dir / "state" / "ranks.json"

    def _record(self) -> None:
        """Remember live ranks on disk, so an agent that crashed can clean up after itself."""
        live = [
            {"pid": r.proc.pid, "job": r.job, "generation": r.generation, "rank": r.slot.rank}
            for r in self._ranks.values()
            if not r.done.is_set()
        ]
        try:
            self._ledger.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._ledger.with_suffix(".tmp")
            tmp.write_text(json.dumps(live))
            os.replace(tmp, self._ledger)
        except OSError as exc:
            log.error("cannot record live ranks in %s: %s", self._ledger, exc)

    def reap_orphans(self) -> list[int]:
        """Kill the ranks a previous, crashed agent left running (it can no longer report
        them, and their GPUs would be handed out twice). Returns the pids killed."""
        try:
            entries = json.loads(self._ledger.read_text())
        except (OSError, ValueError):
            return []
        killed = []
        for entry in entries:
            pid, job = int(entry["pid"]), str(entry["job"])
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                for _ in range(20):  # reads empty while the process is in an exec
                    if environ:
                        break
                    time.sleep(0.05)
                    environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue  # gone already
            if f"PHALANX_JOB_ID={job}".encode() not in environ.split(b"\0"):
                continue  # the pid was reused by something else
            _killpg(pid, signal.SIGKILL)
            killed.append(pid)
            log.warning(
                "killed rank %s of job %s (pid %d) left by a previous agent",
                entry.get("rank"),
                job,
                pid,
                extra={"job": job, "event": "orphan_reaped"},
            )
        self._ledger.unlink(missing_ok=True)
        return killed

    # --- internals -------------------------------------------------------------

    async def _watch(self, rank: Rank) -> None:
        returncode = await rank.proc.wait()
        # Whatever the rank left behind in its session goes with it.
        _killpg(rank.proc.pid, signal.SIGKILL)
        if returncode < 0:
            rank.signal = -returncode
        else:
            rank.code = returncode
        rank.done.set()
        self._release_if_idle(rank.job, rank.generation)
        self._record()
        self._warm_after_exit(rank)
        log.info(
            "job %s gen %d: rank %d exited (code %s, signal %s)",
            rank.job,
            rank.generation,
            rank.slot.rank,
            rank.code,
            rank.signal,
            extra={"job": rank.job, "rank": rank.slot.rank, "event": "rank_exited"},
        )
        step = None
        if self._last_step is not None:
            try:
                step = self._last_step(rank.job, rank.generation, rank.slot.rank)
            except Exception:
                log.exception(
                    "could not look up the last step of job %s rank %d", rank.job, rank.slot.rank
                )
        event = wire.RankEvent(
            node=self.node,
            job=rank.job,
            generation=rank.generation,
            rank=rank.slot.rank,
            event="exited",
            code=rank.code,
            signal=rank.signal,
            pid=rank.proc.pid,
            step=step,
            at=time.time(),
        )
        with contextlib.suppress(Exception):
            await self._report(event)

    def _warm_after_exit(self, rank: Rank) -> None:
        """The last rank of its generation here gone: the job's warm interpreters go now
        when every one exited 0 (the job is done here), else once it stays idle."""
        generation = [
            r for r in self._ranks.values() if r.job == rank.job and r.generation == rank.generation
        ]
        if not all(r.done.is_set() for r in generation):
            return
        if all(r.code == 0 for r in generation):
            self.warm.discard(rank.job)
        else:
            self.warm.discard_when_idle(rank.job, lambda: self._has_ranks(rank.job))


def _in_session(pid: int, rank: Rank) -> bool:
    """Whether ``pid`` is the rank's process or one in its session (a command such as
    ``bash -c "python train.py"`` parks from a child of the process the agent started)."""
    if pid == rank.proc.pid:
        return True
    try:
        return os.getsid(pid) == rank.proc.pid
    except OSError:
        return False


def _write_private(path: Path, obj: object) -> None:
    """Write ``obj`` as JSON to ``path``, readable by this user only (it holds the rank's
    environment, secrets included), replacing it whole."""
    tmp = path.with_name(f"{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def _rank_env(env: dict[str, str], slot: wire.RankSlot, logs: Path, visible: str) -> dict[str, str]:
    """One rank's environment: the start's, with the slot's own variables."""
    rank_env = {
        **env,
        "RANK": str(slot.rank),
        "LOCAL_RANK": str(slot.local_rank),
        "TORCH_FR_DUMP_TEMP_FILE": str(logs / f"nccl-trace-rank-{slot.rank}-"),
    }
    if visible:
        rank_env["CUDA_VISIBLE_DEVICES"] = visible
    return rank_env


async def _wait_done(ranks: list[Rank], timeout: float) -> list[Rank]:
    """Wait up to ``timeout`` s for the ranks to exit; those still running. No wait is left
    behind: a rank that outlives it is waited for by its watcher only."""
    waits = [asyncio.create_task(r.done.wait(), name=f"stop-wait-{r.slot.rank}") for r in ranks]
    try:
        await asyncio.wait(waits, timeout=timeout)
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    return [r for r in ranks if not r.done.is_set()]


def _killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
