"""The rank side of the training channel: the one way a rank tells its agent about training.

Call :func:`step` once per training step, after the step::

    import phalanx.rank

    for step in range(start, steps):
        loss = train_one_step(...)
        if phalanx.rank.step(step, loss=loss, tokens=n, lr=lr).save_now:
            checkpointer.save(step + 1, state())  # the job is about to be preempted

It never blocks and costs microseconds (``bench/rank_step.py``): one datagram to the
agent's progress socket (``PHALANX_PROGRESS_SOCKET``, set by the agent), sent with
``MSG_DONTWAIT``; when the agent is not there or cannot keep up, the report is
dropped and counted (:func:`drops`), never raised into the training loop. Without
``PHALANX_PROGRESS_SOCKET`` (a rank run by hand) it does nothing. The agent uses the
reports to detect hung ranks and answers with :class:`Requests`, e.g. ``save_now``
before the supervisor preempts the job. Answers are read without waiting, so the
answer to one report is returned by the next call (a request is seen a step late).

The job spec's ``guard:`` (``PHALANX_GUARD``, set by the supervisor) makes :func:`step`
watch ``loss`` (:mod:`phalanx.guard`): on a NaN, or a spike that lasts, it tells the agent
once and from then on answers ``rollback`` (train no further; ``ckpt.Checkpointer.save``
saves nothing more); the supervisor stops the gang and restarts it from a checkpoint
before the spike. The restarted ranks learn the steps to skip from :func:`skip` and
:func:`next_step`, and an LR scale from :func:`lr_scale`::

    step = phalanx.rank.next_step(start)
    while step < steps:
        loss = train_one_step(step, lr=base_lr * phalanx.rank.lr_scale(step))
        if phalanx.rank.step(step, loss=loss).rollback:
            hold()  # until the supervisor stops this rank
        step = phalanx.rank.next_step(step + 1)

Each rank binds its own datagram socket for the replies (an abstract-namespace
address on Linux, else a file in a private temporary folder removed on close);
a reply counts only when it comes from the agent's socket path.

:func:`checkpointer` is the rank's ``ckpt.Checkpointer`` with its optimizers attached
(lazy saves), made once per process; a torchrun-style script needs one line::

    ckpt = phalanx.rank.checkpointer(optimizer)  # under Phalanx: the agent's tiers
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import select
import shutil
import socket
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeVar

from phalanx.elastic import Elastic, ElasticSampler
from phalanx.elastic import from_environment as _elastic_from_environment
from phalanx.flight import ANSWER_PREFIX, REQUEST
from phalanx.guard import (
    ENV_GUARD,
    ENV_LR_SCALE,
    ENV_SKIP,
    GuardError,
    LossGuard,
    Trip,
    parse_lr_scale,
    parse_rule,
    parse_skip,
)
from phalanx.guard import next_step as _next_step
from phalanx.progress import (
    MAX_MESSAGE_BYTES,
    NO_REQUESTS,
    ProgressError,
    Requests,
    decode_requests,
    encode_step,
    report_prefix,
)

if TYPE_CHECKING:
    import torch

    from ckpt import Checkpointer

__all__ = [
    "ENV_SOCKET",
    "Elastic",
    "ElasticSampler",
    "RankChannel",
    "Requests",
    "channel",
    "checkpointer",
    "digest",
    "drops",
    "elastic",
    "finished",
    "lr_scale",
    "next_step",
    "restored",
    "run",
    "skip",
    "step",
    "tripped",
]

log = logging.getLogger(__name__)

ENV_SOCKET: Final = "PHALANX_PROGRESS_SOCKET"
# With no agent at the path (not bound yet, or gone), reports are dropped without trying
# for this long: a failed send costs more than a successful one.
NO_AGENT_RETRY_S: Final = 1.0
_SAVE_NOW: Final = Requests(save_now=True)
_ROLLBACK: Final = Requests(rollback=True)
_SAVE_NOW_ROLLBACK: Final = Requests(save_now=True, rollback=True)


class RankChannel:
    """One rank's channel to its agent's progress socket at ``path`` (None: a no-op).

    ``sent`` counts the reports the kernel took, ``drops`` those it did not (no agent,
    a full queue) or that could not be encoded. ``guard``: judges every ``loss`` reported
    (:mod:`phalanx.guard`). Not thread-safe: call it from the training loop. An invalid
    ``job``, ``generation`` or ``rank`` raises :class:`~phalanx.progress.ProgressError`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        job: str = "",
        generation: int = 0,
        rank: int = 0,
        guard: LossGuard | None = None,
    ) -> None:
        self.path = os.fspath(path) if path else None
        self.guard = guard if path else None
        self.job = job
        self.generation = generation
        self.rank = rank
        self.pid = os.getpid()
        self.sent = 0
        self.drops = 0
        self.last_step = 0  # the last step reported (where a parked rank left off)
        self._warned = False
        self._retry_at = 0.0
        self._sock: socket.socket | None = None
        if self.path is not None:
            self._prefix = report_prefix(job, generation, rank, self.pid)
            self._sock, folder = _reply_socket()
            self._finalizer = weakref.finalize(self, _close, self._sock, folder, self.pid)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> RankChannel:
        """The channel the agent set up for this rank; a no-op one without it."""
        env = os.environ if environ is None else environ
        path = env.get(ENV_SOCKET)
        if not path:
            return cls(None)
        try:
            job = env["PHALANX_JOB_ID"]
            generation = int(env["PHALANX_GENERATION"])
            rank = int(env.get("RANK", "0"))
            guard = None
            if rule := env.get(ENV_GUARD):
                try:
                    guard = LossGuard(parse_rule(rule))
                except GuardError as exc:
                    log.warning("the loss guard is off: %s", exc)
            watch_flight(env, rank)
            return cls(path, job=job, generation=generation, rank=rank, guard=guard)
        except (KeyError, ValueError) as exc:  # ProgressError is a ValueError
            log.warning(
                "%s is set but the job's environment is not (%r): progress is not reported",
                ENV_SOCKET,
                exc,
            )
            return cls(None)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def step(self, step: int, **scalars: float) -> Requests:
        """Report that ``step`` is done, with its ``scalars``; return the agent's requests."""
        sock = self._sock
        if sock is None:
            return NO_REQUESTS
        self.last_step = step
        guard = self.guard
        if guard is not None:
            if guard.tripped is not None:
                return self._requests(sock)  # tripped: the supervisor rolls the gang back
            loss = scalars.get("loss")
            if loss is not None and (trip := guard.see(step, float(loss))) is not None:
                self._tripped(trip)
        now = time.time()
        if now < self._retry_at:
            self.drops += 1
            return self._requests(sock)
        try:
            data = encode_step(self._prefix, step, now, scalars)
        except ProgressError as exc:
            self.drops += 1
            if not self._warned:
                self._warned = True
                log.warning("phalanx.rank.step(%r): not reported: %s", step, exc)
            return self._requests(sock)
        try:
            sock.sendto(data, socket.MSG_DONTWAIT, self.path)  # type: ignore[arg-type]
            self.sent += 1
        except (FileNotFoundError, ConnectionRefusedError):  # no agent there (now)
            self.drops += 1
            self._retry_at = now + NO_AGENT_RETRY_S
        except OSError:  # EAGAIN, ENOBUFS: the agent's queue is full
            self.drops += 1
        return self._requests(sock)

    def restored(self, step: int, took_s: float) -> None:
        """Report that this rank restored checkpoint ``step`` in ``took_s`` seconds (once,
        before its first step: the supervisor times a recovery's restore with it)."""
        self._send_kind("restored", step, {"took_s": took_s})

    def finished(self, step: int) -> None:
        """Report that this rank took its last step, ``step``: whatever it does next
        (evaluation, export, waiting in a barrier) is not a hang."""
        self._send_kind("finished", step, {})

    def digest(self, step: int, value: int) -> None:
        """Report the digest of this rank's parameters after ``step`` (64 bits)."""
        value &= (1 << 64) - 1
        self._send_kind("digest", step, {"hi": float(value >> 32), "lo": float(value & 0xFFFFFFFF)})

    def _tripped(self, trip: Trip) -> None:
        log.error(
            "phalanx.rank: the loss guard tripped at step %d (%s since step %d: %r, the "
            "mean before it %r): training stops here; the supervisor rolls the gang back",
            trip.step,
            trip.kind,
            trip.onset,
            trip.value,
            trip.baseline,
        )
        scalars = {"onset": float(trip.onset), "nan": 1.0 if trip.kind == "nan" else 0.0}
        if math.isfinite(trip.value):
            scalars["value"] = trip.value
        if trip.baseline is not None:
            scalars["baseline"] = trip.baseline
        self._send_kind("guard", trip.step, scalars)

    def _send_kind(self, kind: str, step: int, scalars: Mapping[str, float]) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            data = encode_step(self._prefix, step, time.time(), scalars, kind=kind)
            sock.sendto(data, socket.MSG_DONTWAIT, self.path)  # type: ignore[arg-type]
            self.sent += 1
        except (ProgressError, OSError):
            self.drops += 1

    def announce_park(self, step: int) -> None:
        """Tell the agent this rank is parked (:meth:`park` waits for the answer)."""
        self._send_kind("parked", step, {})

    def park(self, step: int, timeout_s: float) -> str | None:
        """Tell the agent this rank left its generation alive (an in-process restart,
        :func:`run`) and wait up to ``timeout_s`` for the file of its next generation's
        order; None when none came. The report is sent again every second (a datagram
        the agent's full queue dropped is not the end)."""
        sock = self._sock
        if sock is None:
            return None
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self._send_kind("parked", step, {})
            ready, _w, _x = select.select([sock], [], [], min(left, 1.0))
            while ready:
                try:
                    data, sender = sock.recvfrom(MAX_MESSAGE_BYTES + 1, socket.MSG_DONTWAIT)
                except OSError:
                    break
                if sender != self.path:
                    continue
                with contextlib.suppress(ProgressError):
                    if (resume := decode_requests(data).resume) is not None:
                        return resume
        return None

    def _requests(self, sock: socket.socket) -> Requests:
        save_now = False
        while True:
            try:
                data, sender = sock.recvfrom(MAX_MESSAGE_BYTES + 1, socket.MSG_DONTWAIT)
            except OSError:  # BlockingIOError: nothing (more) to read
                break
            if sender != self.path:
                continue  # not our agent's socket
            with contextlib.suppress(ProgressError):
                save_now |= decode_requests(data).save_now
        if self.guard is not None and self.guard.tripped is not None:
            return _SAVE_NOW_ROLLBACK if save_now else _ROLLBACK
        return _SAVE_NOW if save_now else NO_REQUESTS

    def close(self) -> None:
        """Release the reply socket (and its folder); later calls of :meth:`step` do nothing."""
        if self._sock is not None:
            self._sock = None
            self._finalizer()


# --- the flight recorder, on the agent's request ------------------------------------------

ENV_FR_DUMP: Final = "TORCH_FR_DUMP_TEMP_FILE"  # set by the agent: FOLDER/nccl-trace-rank-
FLIGHT_POLL_S: Final = 0.5
_flight_watch_pid: int | None = None
_flight_epoch = 0  # a watcher of an earlier epoch ends (an in-process restart's new paths)
_forked = False  # this process is a fork of one that imported this module


def _mark_forked() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_mark_forked)


def flight_dump() -> bytes | str:
    """This process's flight recorder (its collectives, NCCL or gloo) as torch pickles
    it, or why there is none."""
    torch = sys.modules.get("torch")  # only what the rank itself imported
    if torch is None:
        return "torch is not imported"
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return "no process group"
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None)  # torch >= 2.7, any backend
    if dump is None and str(dist.get_backend()) == "nccl":
        dump = getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return f"torch {torch.__version__} has no flight recorder for this backend"
    try:
        # No stack traces: symbolizing them imports some 800 modules (sympy among them),
        # 1.4 s on a quiet core and more than the agent waits on a busy one.
        got = dump(includeStackTraces=False)
    except TypeError:  # an older signature
        got = dump()
    return got if isinstance(got, bytes) else f"the flight recorder gave {type(got).__name__}"


# What answers the agent's request: a test or a tool may put its own here.
FLIGHT_DUMPER: Callable[[], bytes | str] = flight_dump


def watch_flight(env: Mapping[str, str], rank: int) -> None:
    """Start, once per process, the thread that answers the agent's requests for this
    rank's flight recorder (:mod:`phalanx.flight`): the training loop may be stuck in a
    collective, so a thread of its own watches for the request file and writes the dump
    where torch writes it on a timeout, then its answer (dumped, or why not)."""
    global _flight_watch_pid
    prefix = env.get(ENV_FR_DUMP)
    if not prefix or _flight_watch_pid is not None or _forked:
        return  # one per rank: a forked child (a data loader's worker) leaves it to the rank
    _flight_watch_pid = os.getpid()
    folder = os.path.dirname(prefix)
    threading.Thread(
        target=_flight_loop,
        args=(
            os.path.join(folder, REQUEST),
            os.path.join(folder, f"{ANSWER_PREFIX}{rank}"),
            f"{prefix}{rank}",
            _flight_epoch,
        ),
        name="phalanx-flight-recorder",
        daemon=True,
    ).start()


def _flight_loop(request: str, answer: str, dump_path: str, epoch: int = 0) -> None:
    seen = _mtime(request)  # a request from before this process is not for it
    while epoch == _flight_epoch:
        time.sleep(FLIGHT_POLL_S)
        now = _mtime(request)
        if now is None or now == seen:
            continue
        seen = now
        try:
            got = FLIGHT_DUMPER()
        except Exception as exc:  # never into the training process
            got = f"{type(exc).__name__}: {exc}"
        try:
            if isinstance(got, bytes):
                _write_atomically(dump_path, got)
                note = "dumped"
            else:
                note = f"none: {got}"
            _write_atomically(answer, f"{note}\n".encode())
        except OSError as exc:
            log.warning("could not write the flight recorder's answer: %s", exc)


def _mtime(path: str) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _write_atomically(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _reply_socket() -> tuple[socket.socket, str | None]:
    """A non-blocking datagram socket bound to an address of its own, and the folder to
    remove when it closes (None: an abstract address, nothing on disk)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    if sys.platform.startswith("linux"):
        try:
            sock.bind("")  # autobind: a unique abstract address
            return sock, None
        except OSError:
            pass
    folder = tempfile.mkdtemp(prefix="phalanx-rank-")
    try:
        sock.bind(os.path.join(folder, "r.sock"))
    except OSError:
        sock.close()
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return sock, folder


def _close(sock: socket.socket, folder: str | None, owner: int) -> None:
    sock.close()
    if folder is not None and os.getpid() == owner:  # a forked child leaves it to its parent
        shutil.rmtree(folder, ignore_errors=True)


_default: RankChannel | None = None


def channel() -> RankChannel:
    """This process's channel, made from the environment at first use (and again in a
    forked child, which must not read its parent's replies)."""
    global _default
    current = _default
    if current is None or current.pid != os.getpid():
        current = _default = RankChannel.from_environment()
    return current


def step(step: int, **scalars: float) -> Requests:
    """Report that ``step`` is done, with figures such as ``loss``, ``grad_norm``,
    ``tokens``, ``lr``, ``data_wait_s`` (floats; NaN and infinities are fine). Returns the
    agent's :class:`Requests`: ``save_now`` asks for a checkpoint at this step."""
    current = _default
    if current is None or current.pid != os.getpid():
        current = channel()
    return current.step(step, **scalars)


def restored(step: int, took_s: float) -> None:
    """Report that this rank restored checkpoint ``step`` in ``took_s`` seconds.
    ``ckpt.Checkpointer.restore`` calls it under Phalanx; a script restoring by other
    means may call it itself."""
    channel().restored(step, took_s)


def finished(step: int) -> None:
    """Report that this rank took its last step, ``step``: call it after the training
    loop, before evaluation, export or the final barrier, none of which is then taken
    for a hang."""
    channel().finished(step)


def drops() -> int:
    """Reports of this process's channel that did not reach the agent."""
    return channel().drops


_checkpointer: tuple[int, Checkpointer] | None = None


def checkpointer(*optimizers: torch.optim.Optimizer, **options: Any) -> Checkpointer:
    """This process's ``ckpt.Checkpointer``, made at the first call (again in a forked
    child), with ``optimizers`` attached: its saves are lazy, each optimizer's next step
    waiting for the copy (``Checkpointer.attach``; none given: saves copy everything
    before they return). Under Phalanx it is the agent's (``Checkpointer()``); ``options``
    go to ``Checkpointer`` at the first call (``dir=PATH`` to run the tiers in-process, by
    hand). A later call attaches its optimizers to the same one and ignores ``options``.
    The script still calls its ``close()`` (or ``wait()``) at the end."""
    global _checkpointer
    if _checkpointer is None or _checkpointer[0] != os.getpid() or _checkpointer[1].closed:
        from ckpt import Checkpointer

        _checkpointer = (os.getpid(), Checkpointer(**options))
    return _checkpointer[1].attach(*optimizers)


def tripped() -> Trip | None:
    """The trip of this process's loss guard (None: it has not tripped, or there is none).
    ``ckpt.Checkpointer.save`` saves nothing once it has: the weights are the spike's."""
    current = _default
    if current is None or current.pid != os.getpid() or current.guard is None:
        return None
    return current.guard.tripped


_skips: tuple[str, tuple[tuple[int, int], ...]] | None = None
_scale: tuple[str, float, int, int] | None = None


def skip() -> tuple[tuple[int, int], ...]:
    """The steps this job skips, as half-open ``(start, stop)`` ranges, sorted: the data
    of every rollback so far (``PHALANX_SKIP``, set by the supervisor; empty without).
    A step's data is what the rank reads for that step: a script whose data position is
    its step (tinylm) skips those batches by skipping the steps (:func:`next_step`)."""
    global _skips
    text = os.environ.get(ENV_SKIP, "")
    if _skips is None or _skips[0] != text:
        ranges: tuple[tuple[int, int], ...] = ()
        if text:
            try:
                ranges = parse_skip(text)
            except GuardError as exc:
                log.error("no step is skipped: %s", exc)
        _skips = (text, ranges)
    return _skips[1]


def elastic() -> Elastic | None:
    """This generation's batch layout when the job spec is elastic (``elastic:``): the
    global batch, micro batch, data-parallel size and accumulation steps, which change
    when the gang shrinks or grows (:mod:`phalanx.elastic`); None otherwise. A
    malformed layout raises ``ValueError``: training on a guessed batch would change
    the run's learning dynamics behind its owner's back."""
    return _elastic_from_environment()


def next_step(step: int) -> int:
    """The first step at or after ``step`` that :func:`skip` does not skip."""
    return _next_step(step, skip())


def lr_scale(step: int) -> float:
    """The factor to scale the learning rate by at ``step``: the guard's ``lr_scale`` for
    the steps after a rollback (``PHALANX_LR_SCALE``), else 1.0."""
    global _scale
    text = os.environ.get(ENV_LR_SCALE, "")
    if not text:
        return 1.0
    if _scale is None or _scale[0] != text:
        try:
            parsed = parse_lr_scale(text)
            _scale = (text, parsed.factor, parsed.start, parsed.until)
        except GuardError as exc:
            log.error("the learning rate is not scaled: %s", exc)
            _scale = (text, 1.0, 0, 0)
    _text, factor, start, until = _scale
    return factor if start <= step < until else 1.0


ENV_DIGEST_EVERY: Final = "PHALANX_DIGEST_EVERY"
_every: tuple[str, int] | None = None


def digest(step: int, model: object) -> int | None:
    """Every ``sdc.every`` steps of the job spec (``PHALANX_DIGEST_EVERY``), the digest of
    ``model``'s parameters after ``step`` (a ``torch.nn.Module`` or tensors), computed on
    their device (:func:`phalanx.digest.digest`) and reported to the agent: the
    supervisor compares the data-parallel replicas' and quarantines the node of the odd
    one out. Other steps, or without the variable: None, at no cost. Call it after the
    optimizer step, on every rank."""
    global _every
    text = os.environ.get(ENV_DIGEST_EVERY, "")
    if not text:
        return None
    if _every is None or _every[0] != text:
        try:
            every = int(text)
        except ValueError:
            every = 0
        if every < 1:
            log.error("%s=%r is not a positive number of steps: no digest", ENV_DIGEST_EVERY, text)
        _every = (text, every)
    every = _every[1]
    if every < 1 or step % every:
        return None
    from phalanx.digest import digest as compute

    value = compute(model)
    channel().digest(step, value)
    return value


# --- in-process restart (the job spec's restart.in_process) ------------------------------

ENV_IN_PROCESS: Final = "PHALANX_IN_PROCESS"  # "1": the agent resumes parked ranks
ENV_PARK_TIMEOUT: Final = "PHALANX_PARK_TIMEOUT_S"
PARK_TIMEOUT_S: Final = 60.0
# A rank that parked and was never resumed exits with this (EX_TEMPFAIL): its agent
# stopped it, or the recovery went another way (a cold start of the gang).
EXIT_NOT_RESUMED: Final = 75
# What gloo says when a peer's process is gone (its connection ended); a timeout, an
# enforce failure or a CUDA error is no peer's failure and ends the rank as before.
_PEER_WORDS: Final = ("connection closed by peer", "connection reset by peer", "broken pipe")
T = TypeVar("T")


def run(train: Callable[[], T], *, backend: str | None = None) -> T:
    """Run ``train`` in the job's process group, and again in the next generation's when a
    peer fails, without this process exiting (the job spec's ``restart.in_process``).

    ``run`` starts the process group (``backend``: NCCL where CUDA is, else gloo) from
    the environment the agent gave the rank, then calls ``train()``, which builds its
    model, restores the gang's checkpoint and trains, as a script's ``main`` would,
    but without ``init_process_group``. When a gloo collective fails because a peer is
    gone (its connection ended: :func:`_peer_failed`; any other exception, a timeout
    included, is this rank's own and ends it), the rank aborts the group and shuts its
    connections down (so that every peer learns of it at once), tells its agent it is
    alive and waits: the supervisor restarts the gang as generation g+1, the agent
    hands this process the new generation's environment (and log file), and
    ``train()`` runs again, restoring from RAM. Only the failed rank's process is
    replaced (from a warm interpreter). Without the agent's word within
    ``PHALANX_PARK_TIMEOUT_S`` (60 s) the rank exits with :data:`EXIT_NOT_RESUMED`.
    On NCCL a failed collective ends the process as before (docs/jobspec.md,
    "In-process restart").

    Outside Phalanx, or for a job without ``restart.in_process``, ``run`` is
    ``init_process_group`` then ``train()``.
    """
    import torch
    import torch.distributed as dist

    group_sockets: set[int] = set()
    given = dict(os.environ)  # what the agent gave this generation (the script may add)
    if os.environ.get(ENV_IN_PROCESS) == "1":
        # What exists now (the imports: torch's hundreds of thousands of objects) lives
        # as long as the process: kept out of the collections, a full one after a
        # failure walks what training made only.
        gc.freeze()
    while True:
        if not dist.is_initialized():
            cuda = torch.cuda.is_available()
            if cuda:  # NCCL's communicator is made on the device current at init
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            before = set(_inet_sockets())
            dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
            group_sockets = set(_inet_sockets()) - before  # its store's, its pairs'
        try:
            return train()
        except Exception as exc:
            if (
                os.environ.get(ENV_IN_PROCESS) != "1"
                or dist.get_backend() != "gloo"
                or not _peer_failed(exc)
            ):
                raise
            log.warning("phalanx.rank.run: a peer failed: leaving the group", exc_info=True)
            failed_at = _last_step()
        # Out of the except block (the traceback held the frames, and they the group):
        # the group is aborted first, which closes its connections, so that the peers
        # still blocked in a collective with this rank fail at once in turn; then the
        # failed generation's checkpointer goes (its close may wait for a save).
        _leave_group(dist, group_sockets)
        if dist.is_initialized():  # never train again on the failed generation's group
            log.error("phalanx.rank.run: the failed group could not be destroyed: exiting")
            _exit(EXIT_NOT_RESUMED)
        _drop_checkpointer()
        _resume(failed_at, given)


def _peer_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer's process is gone (gloo's words for a connection its
    peer ended), not that this rank failed."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistNetworkError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _PEER_WORDS)


def _last_step() -> int:
    current = _default
    return getattr(current, "last_step", 0) if current is not None else 0


def _leave_group(dist: Any, sockets: set[int]) -> None:
    """Abort the process group and shut its connections down (``sockets``: the inodes of
    the TCP sockets its start opened). An abort alone leaves gloo's connections open
    while anything holds the group (measured with torch 2.13: a peer blocked in a
    collective with this rank waited until this process exited); shut down, every
    peer waiting on this rank fails at once, and in turn leaves, so the whole gang
    learns of the failure within milliseconds instead of at its collective timeout."""
    with contextlib.suppress(Exception):
        dist.distributed_c10d._abort_process_group()
    shut = _shut_down(sockets)
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    log.info("phalanx.rank.run: left the group (%d of its connections shut down)", shut)


def _inet_sockets() -> dict[int, int]:
    """inode -> descriptor of this process's sockets (Linux; elsewhere none)."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(name)
    return out


def _shut_down(inodes: set[int]) -> int:
    """Shut down (both ways) the TCP sockets among ``inodes`` still open here."""
    shut = 0
    for inode, fd in _inet_sockets().items():
        if inode not in inodes:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (
                sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.type == socket.SOCK_STREAM
                # a listener shut down makes gloo's accepting thread abort the process
                and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            ):
                sock.shutdown(socket.SHUT_RDWR)
                shut += 1
        except OSError:
            pass  # already down
        finally:
            sock.close()  # the duplicate; the group's own descriptor stays its to close
    return shut


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


def _drop_checkpointer() -> None:
    """Close the failed generation's checkpointer (its agent fences it from now on)."""
    global _checkpointer
    held, _checkpointer = _checkpointer, None
    if held is not None:
        with contextlib.suppress(Exception):
            held[1].close(timeout=5.0)


def _exit(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _resume(step: int, given: dict[str, str]) -> None:
    """Park until the agent resumes this process as a rank of the next generation, then
    take that generation's environment (``given``: the last one's, updated in place)
    and log; exit when no word comes."""
    global _default, _flight_watch_pid, _flight_epoch
    current = channel()
    try:
        timeout = float(os.environ.get(ENV_PARK_TIMEOUT, PARK_TIMEOUT_S))
    except ValueError:
        timeout = PARK_TIMEOUT_S
    # Parked at once (the agent may be waiting to resume this rank). On a GPU the failed
    # generation's objects held in cycles (model, optimizer, DDP's reducer) are
    # collected now, before the next one allocates device memory again (on the reference
    # machine a collection costs 0.3 s even with the imports frozen); on a CPU they go
    # with Python's own collections.
    current.announce_park(step)
    if _cuda_in_use():
        gc.collect()
    path = current.park(step, timeout)
    if path is None:
        log.error(
            "phalanx.rank.run: no next generation within %.0f s (the recovery went another "
            "way, or the agent is gone): exiting with %d",
            timeout,
            EXIT_NOT_RESUMED,
        )
        _exit(EXIT_NOT_RESUMED)
    try:
        with open(path, "rb") as fh:
            order = json.loads(fh.read())
        env, log_path = order["env"], order["log"]
        if not isinstance(env, dict) or not isinstance(log_path, str):
            raise TypeError("env must be an object and log a path")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.error("phalanx.rank.run: the agent's resume order %s is unusable: %s", path, exc)
        _exit(EXIT_NOT_RESUMED)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # it holds the environment, secrets included
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    # The new generation's variables; those the last one had and this one has not go,
    # unless the script changed them (what the script set itself stays).
    for key, value in given.items():
        if key not in env and os.environ.get(key) == value:
            del os.environ[key]
    os.environ.update(env)
    given.clear()
    given.update(env)
    current.close()
    _default = None  # the next report is the new generation's
    _flight_watch_pid = None  # a watcher of the new generation's flight-recorder paths
    _flight_epoch += 1  # ... and the last one's ends
    log.info(
        "phalanx.rank.run: resumed as rank %s of generation %s",
        env.get("RANK"),
        env.get("PHALANX_GENERATION"),
    )
