"""The rank side of agent mode: ``Checkpointer()`` under Phalanx talks to its agent.

The agent gives every rank ``PHALANX_AGENT_SOCKET``, ``PHALANX_JOB_ID``,
``PHALANX_GENERATION``, ``RANK`` and ``WORLD_SIZE``. The agent owns the RAM
tier (its segments in ``/dev/shm`` are named ``ckpt.namespace_for(job, rank)``
and outlive the rank) and runs the write-down engine; the rank only copies.
Over the unix socket (HTTP, JSON bodies; served by agentd, mode 0600):

=====  ====================  ==================================================
POST   /v1/ckpt/hello        the job's checkpoint plan (tiers, interval)
POST   /v1/ckpt/acquire      a free RAM slot for step S of N bytes: its path
                             (or ``skipped`` under ``when_busy="skip"``)
POST   /v1/ckpt/submit       the slot now holds step S: seal it and write it down
POST   /v1/ckpt/reserve      allocate every slot for N bytes now
POST   /v1/ckpt/wait         until step S is committed on every configured tier;
                             409 names a failed tier, 504 the tiers still missing
GET    /v1/ckpt/restore      the step the gang restores from (or the one asked for),
                             with where this rank's copy lies, nearest first (RAM
                             or disk: a path to read); ``unavailable`` says why
                             there is none when committed steps exist
POST   /v1/ckpt/stage        step S's copy at the peer or object tier, read into a free
                             RAM slot of the rank's and verified there: its path (read
                             as a RAM copy), ``gone`` (no copy), or ``staged: false``
                             (no slot free: stream it instead)
GET    /v1/ckpt/shard        one shard's bytes from the peer or object tier, streamed,
                             its Content-Length the catalog's size (empty: no copy)
POST   /v1/ckpt/report       a copy the rank found corrupt or gone: the agent tells
                             the supervisor, whose catalog stops offering it
=====  ====================  ==================================================

Each body and each answer is a model of ``ckpt.protocol`` (a refusal is an
``ErrorReply``), which agentd's routes parse and build too.

A slot is written between acquire and submit by the rank alone (the agent
never hands a busy slot out again); the agent seals it (xxh3) and carries it
down, so the training process pays for one memory copy per save.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import mmap
import os
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any, Final, NoReturn, TypeVar
from urllib.parse import urlencode

from pydantic import BaseModel, ValidationError

from ckpt.errors import AgentError, CheckpointError, ShardCorrupt, ShardRef, TierError
from ckpt.protocol import (
    AcquireReply,
    AcquireRequest,
    ErrorReply,
    HelloReply,
    HelloRequest,
    ReportReply,
    ReportRequest,
    ReserveReply,
    ReserveRequest,
    RestorePlan,
    RestoreQuery,
    ShardQuery,
    StageReply,
    StageRequest,
    SubmitReply,
    SubmitRequest,
    TierName,
    WaitReply,
    WaitRequest,
    problems,
)
from ckpt.ram import WhenBusy, pin_for_dma, populate_for_write, unmap

__all__ = ["AgentClient", "AgentEnv", "AgentError"]

R = TypeVar("R", bound=BaseModel)

_ERROR_NBYTES: Final = 1 << 16  # the most of an error answer ever read

ENV_KEYS = ("PHALANX_AGENT_SOCKET", "PHALANX_JOB_ID", "PHALANX_GENERATION", "RANK", "WORLD_SIZE")


@dataclass(frozen=True, slots=True)
class AgentEnv:
    """What the agent told the rank about itself, from the environment."""

    socket: str
    job: str
    generation: int
    rank: int
    world_size: int

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> AgentEnv:
        env = dict(os.environ if environ is None else environ)
        missing = [k for k in ENV_KEYS if not env.get(k)]
        if missing:
            raise CheckpointError(
                f"Checkpointer() without dir= runs under Phalanx, but {', '.join(missing)} "
                "is not set (the agent sets it for every rank): pass dir=PATH to run the "
                "tiers in-process"
            )
        try:
            return cls(
                env["PHALANX_AGENT_SOCKET"],
                env["PHALANX_JOB_ID"],
                int(env["PHALANX_GENERATION"]),
                int(env["RANK"]),
                int(env["WORLD_SIZE"]),
            )
        except ValueError as exc:
            raise CheckpointError(f"the Phalanx environment is malformed: {exc}") from exc


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class AgentClient:
    """Requests to the node's agent; each call opens a connection (they are cheap).

    One method per route, each sending its request model and reading its answer with
    one (``ckpt.protocol``); ``call`` sends any body, for what no method covers."""

    def __init__(self, env: AgentEnv, *, timeout_s: float = 30.0) -> None:
        self.env = env
        self.timeout_s = timeout_s
        # path -> (inode, size, map, the address pinned for DMA or None)
        self._maps: dict[str, tuple[int, int, mmap.mmap, int | None]] = {}
        self._maps_lock = threading.Lock()

    def as_rank(self, rank: int) -> AgentClient:
        """This client asking for rank ``rank``'s copies (an elastic gang that changed size
        restores another rank's shard): the same agent and generation."""
        if rank == self.env.rank:
            return self
        other = AgentClient(dataclasses.replace(self.env, rank=rank), timeout_s=self.timeout_s)
        other._maps, other._maps_lock = self._maps, self._maps_lock
        return other

    def _ident(self) -> dict[str, Any]:
        return {"job": self.env.job, "generation": self.env.generation, "rank": self.env.rank}

    # ----------------------------------------------------------------- the routes

    def hello(self) -> HelloReply:
        body = HelloRequest(**self._ident(), world_size=self.env.world_size)
        return self._ask("POST", "/v1/ckpt/hello", body, HelloReply)

    def acquire(
        self, step: int, nbytes: int, *, when_busy: WhenBusy, timeout: float
    ) -> AcquireReply:
        """A free RAM slot for ``step``; the agent waits up to ``timeout`` for one (this
        call 30 s longer), or under ``when_busy="skip"`` answers ``skipped`` at once."""
        body = AcquireRequest(
            **self._ident(), step=step, nbytes=nbytes, when_busy=when_busy, timeout=timeout
        )
        return self._ask("POST", "/v1/ckpt/acquire", body, AcquireReply, timeout=timeout + 30)

    def submit(self, step: int, slot: int, nbytes: int, *, abort: bool = False) -> SubmitReply:
        body = SubmitRequest(**self._ident(), step=step, slot=slot, nbytes=nbytes, abort=abort)
        return self._ask("POST", "/v1/ckpt/submit", body, SubmitReply)

    def reserve(self, nbytes: int) -> ReserveReply:
        body = ReserveRequest(**self._ident(), nbytes=nbytes)
        return self._ask("POST", "/v1/ckpt/reserve", body, ReserveReply)

    def wait(self, step: int, timeout: float) -> WaitReply:
        """Until ``step`` is committed on every tier (this call 30 s longer)."""
        body = WaitRequest(**self._ident(), step=step, timeout=timeout)
        return self._ask("POST", "/v1/ckpt/wait", body, WaitReply, timeout=timeout + 30)

    def restore_plan(self, step: int | None) -> RestorePlan:
        query = RestoreQuery(job=self.env.job, rank=self.env.rank, step=step)
        # The agent may wait for its generation's checkpoint catalog first (20 s at most),
        # which the supervisor sends beside the ranks' start.
        return self._ask(
            "GET", "/v1/ckpt/restore", None, RestorePlan, query=query, timeout=self.timeout_s + 30
        )

    def stage(self, step: int, tier: TierName, *, timeout: float | None = None) -> StageReply:
        body = StageRequest(**self._ident(), step=step, tier=tier)
        return self._ask("POST", "/v1/ckpt/stage", body, StageReply, timeout=timeout)

    def report(self, step: int, tier: TierName, error: str) -> ReportReply:
        body = ReportRequest(**self._ident(), step=step, tier=tier, error=error)
        return self._ask("POST", "/v1/ckpt/report", body, ReportReply)

    # ----------------------------------------------------------------- transport

    def _ask(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        reply: type[R],
        *,
        query: BaseModel | None = None,
        timeout: float | None = None,
    ) -> R:
        data = body.model_dump_json().encode() if body is not None else None
        params = query.model_dump(exclude_none=True) if query is not None else None
        payload = self._send(method, path, data, params, timeout)
        try:
            return reply.model_validate_json(payload)
        except ValidationError as exc:
            raise AgentError(
                f"agent: {method} {path}: a malformed answer: {problems(exc)}",
                ref=ShardRef(job=self.env.job, rank=self.env.rank),
            ) from exc

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        query: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Any request, its body (a JSON object) sent with the rank's ``job``,
        ``generation`` and ``rank``; the answer's JSON."""
        data = json.dumps({**self._ident(), **body}).encode() if body is not None else None
        return json.loads(self._send(method, path, data, query, timeout))

    def _send(
        self,
        method: str,
        path: str,
        data: bytes | None,
        query: dict[str, Any] | None,
        timeout: float | None,
    ) -> bytes:
        url = path + ("?" + urlencode(query) if query else "")
        conn = _UnixConnection(self.env.socket, timeout if timeout is not None else self.timeout_s)
        try:
            conn.request(
                method, url, body=data, headers={"Content-Type": "application/json"} if data else {}
            )
            resp = conn.getresponse()
            payload = resp.read()
        except OSError as exc:
            raise AgentError(
                f"the agent at {self.env.socket} did not answer {method} {path}: {exc}"
            ) from exc
        finally:
            conn.close()
        if resp.status >= 300:
            self._refused(method, path, resp.status, payload)
        return payload

    def _refused(self, method: str, path: str, status: int, payload: bytes) -> NoReturn:
        try:
            error = ErrorReply.model_validate_json(payload)
        except ValidationError:  # not the agent's refusal (a proxy's, a crash's): its text
            error = ErrorReply(error=payload[:300].decode(errors="replace") or str(status))
        message = f"agent: {method} {path}: {error.error}"
        ref = ShardRef(job=self.env.job, rank=self.env.rank, step=error.step)
        if error.corrupt:  # the tier's copy is bad, not the tier unreachable
            raise ShardCorrupt(message, ref=ref)
        if error.tier:
            raise TierError(message, tier=error.tier, ref=ref)
        if status == 504:
            raise TimeoutError(message)
        raise AgentError(message, ref=ref, status=status)

    def fetch_shard(
        self, tier: TierName, step: int, nbytes: int, *, timeout: float | None = None
    ) -> bytearray | None:
        """This rank's shard of ``step`` from the peer or object tier, through the agent,
        read into one buffer of ``nbytes`` (the size the restore plan lists); ``None``
        when the tier has no copy. A body of any other size is a ``TierError`` naming
        the tier: a longer one is refused before its excess is read, never buffered."""
        ref = ShardRef(job=self.env.job, rank=self.env.rank, step=step, path=f"{tier}:")
        query = urlencode(
            ShardQuery(job=self.env.job, rank=self.env.rank, step=step, tier=tier).model_dump()
        )
        conn = _UnixConnection(self.env.socket, timeout if timeout is not None else self.timeout_s)
        try:
            conn.request("GET", "/v1/ckpt/shard?" + query)
            resp = conn.getresponse()
            if resp.status >= 300:
                self._refused("GET", "/v1/ckpt/shard", resp.status, resp.read(_ERROR_NBYTES))
            if resp.length == 0:
                return None
            if resp.length is not None and resp.length > nbytes:
                raise TierError(
                    f"the agent sends {resp.length} bytes for step {step}, more than "
                    f"the {nbytes} the catalog lists: refused",
                    tier=tier,
                    ref=ref,
                )
            buffer = bytearray(nbytes)
            view = memoryview(buffer)
            got = 0
            while got < nbytes and (n := resp.readinto(view[got:])):
                got += n
            if got == 0 and resp.length is None:
                return None  # an empty body: the tier has no copy
            if got < nbytes:
                raise TierError(
                    f"the copy of step {step} ended after {got} of its {nbytes} bytes",
                    tier=tier,
                    ref=ref,
                )
            if resp.read(1):
                raise TierError(
                    f"the agent sends more than the {nbytes} bytes the catalog "
                    f"lists for step {step}: refused",
                    tier=tier,
                    ref=ref,
                )
            return buffer
        except (OSError, http.client.HTTPException) as exc:
            raise TierError(
                f"reading the copy of step {step} through the agent at "
                f"{self.env.socket} failed: {exc!r}",
                tier=tier,
                ref=ref,
            ) from exc
        finally:
            conn.close()

    # ----------------------------------------------------------------- slot mapping

    def map_slot(self, path: str) -> mmap.mmap:
        """The rank's shared mapping of one agent-owned slot file (kept and reused)."""
        with self._maps_lock:  # a save, and the slots reserved behind a restore
            return self._map_slot(path)

    def _map_slot(self, path: str) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            known = self._maps.get(path)
            if known is not None and known[:2] == (st.st_ino, st.st_size):
                return known[2]
            if known is not None:  # the agent grew or replaced the slot: let the old map go
                unmap(known[2], known[3])
                del self._maps[path]
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        populate_for_write(mm)  # else the first save into it pays a fault per page
        # A GPU rank: device-to-host copies DMA straight in.
        pinned = pin_for_dma(mm, st.st_size) if "torch" in sys.modules else None
        self._maps[path] = (st.st_ino, st.st_size, mm, pinned)
        return mm

    def close(self) -> None:
        with self._maps_lock:
            for _ino, _size, mm, pinned in self._maps.values():
                unmap(mm, pinned)
            self._maps.clear()


def read_file(path: str) -> mmap.mmap | None:
    """A private read map of a shard or slot file; ``None`` when it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        # Copy-on-write: tensors decode as views, and writing to them never reaches the file.
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
    finally:
        os.close(fd)
