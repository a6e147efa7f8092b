"""Warm interpreters: per job and local rank slot, a Python process that has imported the
job's modules (``restart.warm_imports``) and waits to become that slot's rank.

The rank runner (``agentd.ranks``) keeps one behind every slot of a job whose start
carries a ``warm`` plan and whose command is ``python script.py ...`` or ``python -m
module ...`` (:func:`launch_form`); a start that finds a ready one for a slot hands it
the rank (:meth:`WarmPool.become`) instead of launching a process, and a new one is
started behind it once the new ranks have settled. The process is the agent's child,
in a session of its own, like a rank: the rank runner watches, stops and reports it as
one. The rank side is ``phalanx.warm``.

A warm interpreter is used only where it was started as the rank would be: the same
command, working directory, imports and environment, the per-rank variables
(``PER_RANK_ENV``) aside. One that dies before it becomes a rank is replaced, and
nothing else hears of it; a job whose warm interpreters die before they are ready
``MAX_FAILURES`` times in a row gets cold launches only, and the agent says so. They go
when the job's ranks are stopped for good, when every rank of the job here exited 0,
``IDLE_S`` after its last rank here went, and when the agent stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from phalanx import wire
from phalanx.elastic import ENV_ACCUM_STEPS, ENV_CONSUMED, ENV_DP_SIZE
from phalanx.tasks import Tasks
from phalanx.warm import CODE, READY

log = logging.getLogger(__name__)

# The variables a rank's environment holds that differ from slot to slot and generation
# to generation; a warm interpreter is started with the previous generation's values.
PER_RANK_ENV: Final = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PHALANX_GENERATION",
        "TORCH_FR_DUMP_TEMP_FILE",
        "CUDA_VISIBLE_DEVICES",
        # An elastic job's layout: its size, and the samples consumed at the restore.
        ENV_DP_SIZE,
        ENV_ACCUM_STEPS,
        ENV_CONSUMED,
    }
)
# Room in a warm interpreter's environment for the rank's own, shown in /proc/PID/environ.
ENV_PAD: Final = "PHALANX_WARM_PAD"
ENV_PAD_BYTES: Final = 4096
MAX_FAILURES: Final = 3  # warm interpreters of a job that died before ready, in a row
IDLE_S: Final = 300.0  # a job with no rank here for this long loses its warm interpreters
# The new ranks' first step, before warm interpreters are started behind them (their
# imports compete with the ranks' start for the CPUs); without steps reported, this long.
SETTLE_S: Final = 30.0
# A node with this many CPUs per rank it starts (and at least MIN_CPUS_AT_ONCE) starts
# the warm interpreters behind them at once: a fault in the first seconds of a job then
# finds them ready, and their imports take no CPU the ranks need (a GPU node has 12-28
# cores per GPU). A smaller node (a laptop, a CI runner) waits for the first step.
CPUS_PER_RANK_AT_ONCE: Final = 4
MIN_CPUS_AT_ONCE: Final = 8

_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")

Settled = Callable[[], Awaitable[None]]


def launch_form(command: Sequence[str]) -> tuple[str, str] | None:
    """``("script", path)`` for ``python path ...``, ``("module", name)`` for ``python -m
    name ...``; None for any other command (it gets a cold launch)."""
    if len(command) < 2 or not _PYTHON.match(os.path.basename(command[0])):
        return None
    if command[1] == "-m":
        return ("module", command[2]) if len(command) > 2 and command[2] else None
    if not command[1] or command[1].startswith("-"):
        return None
    return ("script", command[1])


def refill_at_once(cpus: int, ranks: int) -> bool:
    """Whether a node with ``cpus`` CPUs starts the warm interpreters behind ``ranks``
    ranks it starts at once, rather than after their first step."""
    return cpus >= max(MIN_CPUS_AT_ONCE, CPUS_PER_RANK_AT_ONCE * ranks)


def template_for(
    req: wire.StartRanksArgs, workdir: Path, env: Mapping[str, str]
) -> Template | None:
    """How a rank of this start is started, for a warm interpreter to match; None: the
    job keeps none (no ``warm`` plan, or a command no warm interpreter can run)."""
    if req.warm is None or launch_form(req.command) is None:
        return None
    return Template(tuple(req.command), str(workdir), dict(env), tuple(req.warm.imports))


def same_but_per_rank(a: Mapping[str, str], b: Mapping[str, str]) -> bool:
    """Whether two environments differ in the per-rank variables only."""
    return {k: v for k, v in a.items() if k not in PER_RANK_ENV} == {
        k: v for k, v in b.items() if k not in PER_RANK_ENV
    }


def _cmdline_bytes(argv: Sequence[str]) -> int:
    return sum(len(os.fsencode(a)) + 1 for a in argv)


@dataclass(frozen=True)
class Template:
    """How a slot's rank was last started: what a warm interpreter behind it must match."""

    command: tuple[str, ...]
    workdir: str
    env: Mapping[str, str]
    imports: tuple[str, ...]

    def matches(self, other: Template) -> bool:
        return (
            self.command == other.command
            and self.workdir == other.workdir
            and self.imports == other.imports
            and same_but_per_rank(self.env, other.env)
        )


@dataclass(frozen=True, slots=True)
class Cold:
    """A rank launched cold, not from a warm interpreter: why (the start's ack, and then
    the recovery's incident, say it)."""

    reason: str


@dataclass(eq=False)
class Warm:
    job: str
    local_rank: int
    template: Template
    proc: asyncio.subprocess.Process
    sock: socket.socket
    started_at: float
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    taken: bool = False  # it became a rank: the rank runner owns it now
    watcher: asyncio.Task[None] | None = None
    discarded: bool = False


class WarmPool:
    """The warm interpreters of one agent, by (job, local rank)."""

    def __init__(
        self,
        node: str,
        data_dir: Path,
        *,
        on_spawn: Callable[[int], None] | None = None,
        idle_s: float = IDLE_S,
    ) -> None:
        """``on_spawn``: called with the pid of each process started (the rank runner
        keeps it off the checkpoint write-down CPUs, as it does a rank)."""
        self.node = node
        self.data_dir = data_dir
        self.idle_s = idle_s
        self._on_spawn = on_spawn
        self._warm: dict[tuple[str, int], Warm] = {}
        self._failures: dict[str, int] = {}  # job -> deaths before ready, in a row
        self._given_up: set[str] = set()
        self._discards: dict[str, int] = {}  # job -> how often it was discarded (a fence)
        self._refills: dict[str, asyncio.Task[None]] = {}
        self._spawning: set[asyncio.Task[None]] = set()  # refills starting processes
        self._locks: dict[str, asyncio.Lock] = {}  # one refill of a job at a time
        self._idle: dict[str, asyncio.Task[None]] = {}
        self._prewarmed: set[str] = set()  # jobs with no rank here, kept for as a spare
        self._tasks = Tasks(f"warm interpreters of {node}")
        self.closing = False

    # --- queries -------------------------------------------------------------

    def pids(self, job: str | None = None) -> dict[tuple[str, int], int]:
        """The warm interpreters' pids, by (job, local rank)."""
        return {
            key: w.proc.pid
            for key, w in self._warm.items()
            if (job is None or key[0] == job) and w.proc.returncode is None
        }

    def ready(self, job: str, local_rank: int) -> bool:
        w = self._warm.get((job, local_rank))
        return w is not None and w.ready.is_set() and w.proc.returncode is None

    # --- taking one ----------------------------------------------------------

    def take(self, job: str, local_rank: int, template: Template) -> Warm | Cold:
        """The slot's ready warm interpreter if it matches ``template``, out of the pool
        (the caller hands it a rank with :meth:`become`); :class:`Cold`: launch cold,
        and why."""
        w = self._warm.get((job, local_rank))
        if job in self._given_up:
            return Cold("its warm interpreters kept dying before they were ready")
        if w is None:
            return Cold("no warm interpreter was started for it yet")
        if w.proc.returncode is not None:
            return Cold("its warm interpreter died before it was used")
        if not w.ready.is_set():
            return Cold("its warm interpreter was still importing")
        if not w.template.matches(template):
            log.info(
                "job %s local rank %d: the warm interpreter was started for another "
                "command, working directory, imports or environment; a cold launch",
                job,
                local_rank,
            )
            return Cold(
                "its warm interpreter was started for another command, working "
                "directory, imports or environment"
            )
        del self._warm[(job, local_rank)]
        w.taken = True
        if w.watcher is not None:
            w.watcher.cancel()  # it only waits for the exit, which the rank runner reports
        return w

    async def start_rank(
        self,
        req: wire.StartRanksArgs,
        slot: wire.RankSlot,
        template: Template | None,
        env: dict[str, str],
        workdir: Path,
        log_path: Path,
    ) -> asyncio.subprocess.Process | Cold:
        """The slot's warm interpreter, told to become its rank; :class:`Cold`: launch it
        cold, and why."""
        if template is None:
            if req.warm is None:
                return Cold("the job keeps no warm interpreters (restart.warm is off)")
            return Cold("its command is not `python script.py` or `python -m module`")
        warm = self.take(req.job, slot.local_rank, template)
        if isinstance(warm, Cold):
            return warm
        try:
            with log_path.open("ab"):  # as a cold launch's log is opened, before the rank runs
                pass
            await self.become(warm, argv=req.command, env=env, cwd=workdir, log_path=log_path)
        except OSError as exc:
            log.warning(
                "job %s rank %d: the warm interpreter (pid %d) is gone (%s); a cold launch",
                req.job,
                slot.rank,
                warm.proc.pid,
                exc,
            )
            _killpg(warm.proc.pid, signal.SIGKILL)
            return Cold("its warm interpreter died before it could become the rank")
        return warm.proc

    async def become(
        self,
        w: Warm,
        *,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        log_path: Path,
    ) -> None:
        """Tell ``w`` to become the rank. Raises ``OSError`` when it is gone (it died
        since it said ready): the caller launches the rank cold."""
        form = launch_form(argv)
        assert form is not None
        order = {
            "argv": list(argv),
            "env": dict(env),
            "cwd": str(cwd),
            "log": str(log_path),
            "script": form[1] if form[0] == "script" else None,
            "module": form[1] if form[0] == "module" else None,
        }
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(w.sock, json.dumps(order).encode())
            w.sock.shutdown(socket.SHUT_WR)
        finally:
            w.sock.close()

    # --- keeping them --------------------------------------------------------

    def refill(self, job: str, templates: Mapping[int, Template], settled: Settled | None) -> None:
        """Once ``settled`` returns (the new ranks' first step; None: now), have a warm
        interpreter behind each local rank in ``templates``, started as that slot's rank
        was."""
        if self.closing or job in self._given_up:
            return
        self.cancel_idle(job)
        self._cancel_refill(job)
        task = self._tasks.spawn(self._refill(job, dict(templates), settled), name=f"warm-{job}")
        if task is not None:
            self._refills[job] = task

    def prewarm(
        self,
        job: str,
        templates: Mapping[int, Template],
        lease_s: float,
        busy: Callable[[], bool],
    ) -> bool:
        """Have a warm interpreter behind each local rank in ``templates`` now, for a job
        with no rank here (a hot spare's, for the job it may take over); they go
        ``lease_s`` from now unless ``busy()`` (a rank of the job starts or runs here) or
        another prewarm or a refill came meanwhile. Those already there and matching
        stay. False: none are kept for the job here (the agent is stopping, or gave up on
        its warm interpreters after they kept dying)."""
        if self.closing or job in self._given_up:
            return False
        self.refill(job, templates, None)
        self._prewarmed.add(job)
        self.discard_when_idle(job, busy, after_s=lease_s)
        return True

    def drop_prewarmed(self, keep: str) -> None:
        """This node starts ranks of ``keep``: it is no spare now, and the interpreters
        it kept for other jobs it might have taken over go."""
        for job in sorted(self._prewarmed - {keep}):
            log.info("job %s: this node runs job %s now; its prewarmed interpreters go", job, keep)
            self.discard(job)
        self._prewarmed.clear()

    def _cancel_refill(self, job: str) -> None:
        """Cancel the job's refill while it waits; one already starting processes goes
        on, and the fence (``_discards``) stops it."""
        task = self._refills.pop(job, None)
        if task is not None and task not in self._spawning:
            task.cancel()

    async def _refill(
        self, job: str, templates: dict[int, Template], settled: Settled | None
    ) -> None:
        if settled is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SETTLE_S):
                    await settled()
        fence = self._discards.get(job, 0)
        lock = self._locks.setdefault(job, asyncio.Lock())
        async with lock:
            me = asyncio.current_task()
            assert me is not None
            self._spawning.add(me)  # not cancelled from here: nothing may be half started
            try:
                for local_rank, template in sorted(templates.items()):
                    current = self._warm.get((job, local_rank))
                    if current is not None and current.template.matches(template):
                        continue
                    if current is not None:
                        self._discard(current)
                    await self._spawn(job, local_rank, template, fence)
            finally:
                self._spawning.discard(me)

    def discard(self, job: str) -> None:
        """Let the job's warm interpreters go (SIGKILL: they hold nothing)."""
        self._prewarmed.discard(job)
        self._cancel_refill(job)
        self.cancel_idle(job)
        self._discards[job] = self._discards.get(job, 0) + 1
        for w in [w for (j, _), w in self._warm.items() if j == job]:
            self._discard(w)

    def discard_when_idle(
        self, job: str, busy: Callable[[], bool], *, after_s: float | None = None
    ) -> None:
        """``after_s`` (by default ``idle_s``) from now, discard the job's warm
        interpreters unless ``busy()`` (a rank of the job runs here) or a refill came
        meanwhile."""
        self.cancel_idle(job)
        wait = self.idle_s if after_s is None else after_s

        async def later() -> None:
            await asyncio.sleep(wait)
            self._idle.pop(job, None)
            if not busy():
                log.info("job %s: no rank here for %.0f s; its warm interpreters go", job, wait)
                self.discard(job)

        task = self._tasks.spawn(later(), name=f"warm-idle-{job}")
        if task is not None:
            self._idle[job] = task

    def cancel_idle(self, job: str) -> None:
        task = self._idle.pop(job, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def close(self, timeout: float = 10.0) -> None:
        """At agent shutdown: every warm interpreter goes, and is waited for."""
        self.closing = True
        for job in list(self._refills):
            self._cancel_refill(job)
        for job in list(self._idle):
            self.cancel_idle(job)
        for w in list(self._warm.values()):
            self._discard(w)
        await self._tasks.shutdown(timeout=timeout)

    def _discard(self, w: Warm) -> None:
        w.discarded = True
        if self._warm.get((w.job, w.local_rank)) is w:
            del self._warm[(w.job, w.local_rank)]
        # Its watcher closes the socket, once the process is gone (a socket closed under
        # a pending receive would leave that receive waiting for good).
        _killpg(w.proc.pid, signal.SIGKILL)

    async def _spawn(self, job: str, local_rank: int, template: Template, fence: int) -> None:
        """Start a warm interpreter for the slot; one that the job's warm interpreters
        being let go meanwhile (``fence`` passed) overtook goes at once."""
        if self.closing or self._discards.get(job, 0) != fence:
            return
        command = template.command
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = child.fileno()
        argv = [command[0], "-c", CODE, str(fd), ",".join(template.imports)]
        # Room in the arguments for the rank's command, to show in /proc/PID/cmdline.
        pad = _cmdline_bytes(command) - _cmdline_bytes(argv) - 1
        if pad > 0:
            argv.append("x" * pad)
        env = {**template.env, ENV_PAD: "x" * ENV_PAD_BYTES}
        folder = self.data_dir / "jobs" / job / "warm"
        try:
            await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
            with (folder / f"local-rank-{local_rank}.log").open("ab") as out:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    cwd=template.workdir,
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=(fd,),
                )
        except BaseException as exc:
            parent.close()
            if not isinstance(exc, OSError):
                raise
            log.warning(
                "job %s: cannot start a warm interpreter (%s): %s; cold launches",
                job,
                command[0],
                exc,
            )
            self._given_up.add(job)
            return
        finally:
            child.close()
        parent.setblocking(False)
        if self._on_spawn is not None:
            self._on_spawn(proc.pid)
        w = Warm(job, local_rank, template, proc, parent, time.time())
        previous = self._warm.get((job, local_rank))
        if previous is not None:
            self._discard(previous)
        self._warm[(job, local_rank)] = w
        watcher = self._tasks.spawn(self._watch(w), name=f"warm-{job}-{local_rank}-{proc.pid}")
        w.watcher = watcher
        if watcher is None:  # shutting down: no watcher, so reap it here
            self._discard(w)
            w.sock.close()
            await proc.wait()
            return
        if self.closing or self._discards.get(job, 0) != fence:
            self._discard(w)
            return
        log.info(
            "job %s local rank %d: warm interpreter started (pid %d)",
            job,
            local_rank,
            proc.pid,
            extra={"job": job, "event": "warm_started"},
        )

    async def _watch(self, w: Warm) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError):
            said = await loop.sock_recv(w.sock, len(READY))
            if said == READY and not w.discarded:
                w.ready.set()
                self._failures.pop(w.job, None)
                log.info(
                    "job %s local rank %d: warm interpreter ready in %.1f s (pid %d)",
                    w.job,
                    w.local_rank,
                    time.time() - w.started_at,
                    w.proc.pid,
                )
        code = await w.proc.wait()
        if w.taken:
            return  # a rank now: the rank runner reports its exit
        _killpg(w.proc.pid, signal.SIGKILL)  # whatever it left in its session
        with contextlib.suppress(OSError):
            w.sock.close()
        if w.discarded or self.closing:
            return
        if self._warm.get((w.job, w.local_rank)) is w:
            del self._warm[(w.job, w.local_rank)]
        log.warning(
            "job %s local rank %d: warm interpreter (pid %d) exited (%s) before it became "
            "a rank; starting another",
            w.job,
            w.local_rank,
            w.proc.pid,
            f"signal {-code}" if code < 0 else f"code {code}",
            extra={"job": w.job, "event": "warm_exited"},
        )
        fence = self._discards.get(w.job, 0)
        if not w.ready.is_set():
            failures = self._failures[w.job] = self._failures.get(w.job, 0) + 1
            if failures >= MAX_FAILURES:
                self._given_up.add(w.job)
                log.error(
                    "job %s: %d warm interpreters in a row died before they were ready "
                    "(see %s); its ranks get cold launches",
                    w.job,
                    failures,
                    self.data_dir / "jobs" / w.job / "warm",
                    extra={"job": w.job, "event": "warm_given_up"},
                )
                self.discard(w.job)
                return
            await asyncio.sleep(float(failures))
        if (
            self.closing
            or self._discards.get(w.job, 0) != fence
            or (w.job, w.local_rank) in self._warm
        ):
            return  # the job's warm interpreters were let go meanwhile, or replaced
        await self._spawn(w.job, w.local_rank, w.template, fence)


def _killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
