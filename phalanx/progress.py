"""The training channel between a rank and its agent: one datagram per step, one format.

A rank (``phalanx.rank``) sends a :class:`StepReport` to its agent's progress socket
(``PHALANX_PROGRESS_SOCKET``, a unix datagram socket) after every step; the agent
(``agentd.progress``) may answer with :class:`Requests` (checkpoint now). Both sides
import this module and nothing else builds or reads these datagrams.

A report is a JSON object of at most :data:`MAX_MESSAGE_BYTES`::

    {"v": 1, "job": "tinylm-abc", "generation": 3, "rank": 5, "pid": 4242,
     "step": 1200, "at": 1718000000.25, "scalars": {"loss": 2.31, "lr": NaN}}

Scalars are any floats, NaN and +-Infinity included (written as JSON's common
``NaN`` / ``Infinity`` extension, which Python's ``json`` reads back). A reply is
``{"v": 1, "save_now": true}``. :func:`decode_report` and :func:`decode_requests`
raise :class:`ProgressError`, and only it, on anything else.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

VERSION: Final = 1
# phalanx.wire's limits, repeated so that a rank importing this pays no pydantic import
# (~0.1 s); tests/unit/test_progress.py checks that they agree.
JOB_ID_PATTERN: Final = r"^[a-z0-9][a-z0-9-]{0,80}$"
MAX_STEP: Final = 10**12 - 1
MAX_RANK: Final = 10**5 - 1
MAX_MESSAGE_BYTES: Final = 4096  # one datagram; a report with every scalar allowed fits
MAX_SCALARS: Final = 32
MAX_SCALAR_NAME: Final = 64
MAX_GENERATION: Final = 2**63 - 1

_JOB_RE = re.compile(JOB_ID_PATTERN)
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$")
_REPORT_KEYS = frozenset({"v", "job", "generation", "rank", "pid", "kind", "step", "at", "scalars"})
KINDS: Final = ("step", "restored", "finished", "guard", "digest", "parked")
MAX_RESUME_PATH: Final = 1024


class ProgressError(ValueError):
    """A datagram that is not a valid progress message (or a report too big to send)."""


@dataclass(frozen=True, slots=True)
class StepReport:
    """One rank finished ``step`` at wall time ``at``; ``scalars`` are its figures.

    ``kind="restored"``: the rank restored checkpoint ``step`` instead (once, at its
    start), ``scalars["took_s"]`` the seconds it took. ``kind="finished"``: the rank took
    its last step, ``step``; what it does from now on (evaluation, export, waiting for
    the others) is no hang. ``kind="guard"``: the rank's loss guard tripped at ``step``
    (:mod:`phalanx.guard`); ``scalars``: ``onset``, ``nan`` (1.0 for a NaN or infinite
    loss, 0.0 for a spike), ``value`` (the first bad loss, when finite) and ``baseline``
    (the mean before it, when known). ``kind="digest"``: the digest of the rank's
    parameters after ``step`` (``phalanx.digest``), its 64 bits as ``scalars["hi"]`` and
    ``scalars["lo"]`` (32 bits each, exact as floats)."""

    job: str
    generation: int
    rank: int
    pid: int
    step: int
    at: float
    scalars: Mapping[str, float] = field(default_factory=dict)
    kind: str = "step"


@dataclass(frozen=True, slots=True)
class Requests:
    """What the agent asks of the training loop; the answer to ``phalanx.rank.step``.

    ``save_now``: checkpoint at this step (the supervisor is about to preempt the job).
    ``rollback``: this rank's loss guard tripped (:mod:`phalanx.guard`): train no further
    and save nothing more; the supervisor stops the gang and rolls it back. Set by the
    rank's own channel, never sent by the agent; not part of the truth value, which
    stays ``save_now``.
    ``resume``: the answer to a parked rank (``kind="parked"``, an in-process restart):
    the file holding its next generation's order (``phalanx.rank.run``).
    """

    save_now: bool = False
    rollback: bool = False
    resume: str | None = None

    def __bool__(self) -> bool:
        return self.save_now


NO_REQUESTS: Final = Requests()


def report_prefix(job: str, generation: int, rank: int, pid: int) -> str:
    """The part of a rank's reports that never changes, checked once (see :func:`encode_step`)."""
    if not _JOB_RE.match(job):
        raise ProgressError(f"job {job!r} is not a job id")
    for key, value, high in (
        ("generation", generation, MAX_GENERATION),
        ("rank", rank, MAX_RANK),
        ("pid", pid, 2**31 - 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise ProgressError(f"{key} {value!r} is not an integer in [0, {high}]")
    if generation < 1:
        raise ProgressError(f"generation {generation} is not at least 1")
    return f'{{"v":{VERSION},"job":"{job}","generation":{generation},"rank":{rank},"pid":{pid},'


def encode_step(
    prefix: str, step: int, at: float, scalars: Mapping[str, float], kind: str = "step"
) -> bytes:
    """A report's datagram from its :func:`report_prefix` and what changes every step.

    Written by hand, not by ``json.dumps``: the training loop pays for every call, and
    every string in it is checked to need no escaping (job id, identifiers)."""
    try:
        step = operator.index(step)
        if not 0 <= step <= MAX_STEP:
            raise ProgressError(f"step {step} is not in [0, {MAX_STEP}]")
        if len(scalars) > MAX_SCALARS:
            raise ProgressError(f"{len(scalars)} scalars; at most {MAX_SCALARS}")
        parts = []
        for name, value in scalars.items():
            if name not in _good_names:
                _check_name(name)
                if len(_good_names) < 1024:
                    _good_names.add(name)
            parts.append(f'"{name}":{_number(value)}')
        if kind not in KINDS:
            raise ProgressError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        head = prefix if kind == "step" else f'{prefix}"kind":"{kind}",'
        data = f'{head}"step":{step},"at":{_number(at)},"scalars":{{{",".join(parts)}}}}}'.encode()
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ProgressError):
            raise
        raise ProgressError(f"report of step {step!r} cannot be encoded: {exc}") from exc
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProgressError(
            f"report of step {step} is {len(data)} bytes; at most {MAX_MESSAGE_BYTES}"
        )
    return data


def encode_report(report: StepReport) -> bytes:
    """The datagram of ``report``; :class:`ProgressError` when it cannot be one."""
    prefix = report_prefix(report.job, report.generation, report.rank, report.pid)
    return encode_step(prefix, report.step, report.at, report.scalars, report.kind)


_SPECIAL = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _number(value: float) -> str:
    """A float as JSON writes it (with the common NaN/Infinity extension)."""
    text = repr(float(value))
    return _SPECIAL.get(text, text) if text[-1] in "nf" else text


def decode_report(data: bytes) -> StepReport:
    """Parse and check one report datagram; raises :class:`ProgressError` on garbage."""
    obj = _object(data)
    if unknown := set(obj) - _REPORT_KEYS:
        raise ProgressError(f"unknown fields {sorted(unknown)}")
    job = obj.get("job")
    if not isinstance(job, str) or not _JOB_RE.match(job):
        raise ProgressError(f"job {job!r} is not a job id")
    generation = _int(obj, "generation", 1, MAX_GENERATION)
    rank = _int(obj, "rank", 0, MAX_RANK)
    pid = _int(obj, "pid", 0, 2**31 - 1)
    step = _int(obj, "step", 0, MAX_STEP)
    kind = obj.get("kind", "step")
    if kind not in KINDS:
        raise ProgressError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    at = obj.get("at")
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        raise ProgressError(f"at {at!r} is not a time")
    raw = obj.get("scalars", {})
    if not isinstance(raw, dict) or len(raw) > MAX_SCALARS:
        raise ProgressError(f"scalars must be an object of at most {MAX_SCALARS} numbers")
    scalars: dict[str, float] = {}
    for name, value in raw.items():
        _check_name(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProgressError(f"scalar {name} is {type(value).__name__}, not a number")
        scalars[name] = float(value)
    return StepReport(
        job=job,
        generation=generation,
        rank=rank,
        pid=pid,
        step=step,
        at=float(at),
        scalars=scalars,
        kind=kind,
    )


def encode_requests(requests: Requests) -> bytes:
    obj: dict[str, Any] = {"v": VERSION, "save_now": requests.save_now}
    if requests.resume is not None:
        obj["resume"] = requests.resume
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_requests(data: bytes) -> Requests:
    """Parse one reply datagram; raises :class:`ProgressError` on garbage."""
    obj = _object(data)
    save_now = obj.get("save_now", False)
    if not isinstance(save_now, bool):
        raise ProgressError(f"save_now {save_now!r} is not a boolean")
    resume = obj.get("resume")
    if resume is not None and (
        not isinstance(resume, str) or not resume or len(resume) > MAX_RESUME_PATH
    ):
        raise ProgressError(f"resume {str(resume)[:80]!r} is not a file path")
    return Requests(save_now=save_now, resume=resume)


def _object(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProgressError(
            f"{len(data)} bytes; a progress message has at most {MAX_MESSAGE_BYTES}"
        )
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ProgressError(f"not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProgressError("not a JSON object")
    if obj.get("v") != VERSION:
        raise ProgressError(f"version {obj.get('v')!r}; this side speaks {VERSION}")
    return obj


_good_names: set[str] = set()  # names checked once already (the same few, every step)


def _check_name(name: str) -> None:
    if not _NAME_RE.match(name):
        raise ProgressError(
            f"scalar name {name[:80]!r} is not an identifier of at most "
            f"{MAX_SCALAR_NAME} characters"
        )


def _int(obj: dict[str, Any], key: str, low: int, high: int) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ProgressError(f"{key} {value!r} is not an integer in [{low}, {high}]")
    return value
