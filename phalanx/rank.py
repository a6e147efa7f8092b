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

Each rank binds its own datagram socket for the replies (an abstract-namespace
address on Linux, else a file in a private temporary folder removed on close);
a reply counts only when it comes from the agent's socket path.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from typing import Final

from phalanx.progress import (
    MAX_MESSAGE_BYTES,
    NO_REQUESTS,
    ProgressError,
    Requests,
    decode_requests,
    encode_step,
    report_prefix,
)

__all__ = [
    "ENV_SOCKET",
    "RankChannel",
    "Requests",
    "channel",
    "drops",
    "finished",
    "restored",
    "step",
]

log = logging.getLogger(__name__)

ENV_SOCKET: Final = "PHALANX_PROGRESS_SOCKET"
# With no agent at the path (not bound yet, or gone), reports are dropped without trying
# for this long: a failed send costs more than a successful one.
NO_AGENT_RETRY_S: Final = 1.0
_SAVE_NOW: Final = Requests(save_now=True)


class RankChannel:
    """One rank's channel to its agent's progress socket at ``path`` (None: a no-op).

    ``sent`` counts the reports the kernel took, ``drops`` those it did not (no agent,
    a full queue) or that could not be encoded. Not thread-safe: call it from the
    training loop. An invalid ``job``, ``generation`` or ``rank`` raises
    :class:`~phalanx.progress.ProgressError`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        job: str = "",
        generation: int = 0,
        rank: int = 0,
    ) -> None:
        self.path = os.fspath(path) if path else None
        self.job = job
        self.generation = generation
        self.rank = rank
        self.pid = os.getpid()
        self.sent = 0
        self.drops = 0
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
            return cls(path, job=job, generation=generation, rank=rank)
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
        return _SAVE_NOW if save_now else NO_REQUESTS

    def close(self) -> None:
        """Release the reply socket (and its folder); later calls of :meth:`step` do nothing."""
        if self._sock is not None:
            self._sock = None
            self._finalizer()


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
