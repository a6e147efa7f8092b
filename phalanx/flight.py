"""NCCL's flight recorder: which rank a hung gang waits for, from its ranks' dumps.

A rank keeps a ring of its recent collectives (``TORCH_FR_BUFFER_SIZE``, set by the
agent): for each, its process group, its sequence number in that group
(``collective_seq_id``), its name (``nccl:all_reduce``), its state (``scheduled``,
``started`` on the GPU, ``completed``; gloo records ``scheduled`` and marks a finished
one ``retired``). torch writes it as a pickled dict when an NCCL collective times out
(``TORCH_FR_DUMP_TEMP_FILE`` + the rank), and ``torch._C._distributed_c10d``'s
``_dump_fr_trace()`` (``_dump_nccl_trace()`` before torch 2.7) returns it on demand, on
NCCL and gloo alike, which the rank library does when the agent asks
(:mod:`phalanx.rank`, ``fr-request``).

:func:`load` reads a dump without running any code (plain data only); :func:`summarize`
keeps what a verdict needs, per process group: the newest collective the rank entered
and the newest it completed; :func:`culprit` (pure) compares them across the gang. In a
hang, the ranks of a process group that are furthest along wait in collective N that
they entered and did not complete; the rank that never entered N (its newest is older)
is the culprit, the one furthest behind first. When every rank entered N, a rank whose
N never started on its GPU while the others' did is, and so is one that entered another
operation as N than the rest (a mismatch). Else the dumps name no one, and the agents'
progress-based culprit stands.
"""

from __future__ import annotations

import io
import pickle
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

MAX_DUMP_BYTES: Final = 64 * 1024 * 1024  # 20,000 entries with their stack frames fit
REQUEST: Final = "fr-request"  # the agent's request, in the generation's folder
ANSWER_PREFIX: Final = "fr-answer-"  # + the rank: the rank's answer (dumped, or why not)


class DumpError(ValueError):
    """A dump that cannot be read, or is not a flight recorder's; the message says why."""


def _same(data: Any, *_: Any) -> Any:
    return data


# What torch's own pickler may name in a dump: list builders that return their argument
# (torch/jit/_pickle.py), here without importing torch.
_TORCH_BUILDERS: Final = frozenset(
    {"build_intlist", "build_doublelist", "build_boollist", "restore_type_tag"}
)


class _PlainData(pickle.Unpickler):
    """Unpickles plain data only: a dump names no class but torch's list builders, and
    one that does is refused (unpickling a file a rank wrote must not run its code in
    the agent)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.jit._pickle" and name in _TORCH_BUILDERS:
            return _same
        raise pickle.UnpicklingError(f"it names {module}.{name}: a dump holds plain data only")


def load(path: Path) -> dict[str, Any]:
    """The dump at ``path``; :class:`DumpError` when it is unreadable, too large, holds
    anything but plain data, or has no ``entries`` list."""
    try:
        with path.open("rb") as fh:
            data = fh.read(MAX_DUMP_BYTES + 1)
    except OSError as exc:
        raise DumpError(f"{path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_DUMP_BYTES:
        raise DumpError(f"{path}: larger than {MAX_DUMP_BYTES} bytes")
    try:
        dump = _PlainData(io.BytesIO(data)).load()
    except Exception as exc:  # any malformed pickle: a clear error, never a crash
        raise DumpError(f"{path}: not a flight-recorder dump ({exc})") from exc
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise DumpError(f"{path}: not a flight-recorder dump (no entries list)")
    return dump


@dataclass(frozen=True, slots=True)
class Point:
    """One rank's place in one process group: the newest collective it entered (``seq``,
    its ``op`` and ``state``) and the newest it completed (-1: none)."""

    rank: int
    pg: str
    seq: int
    completed: int
    op: str
    state: str


def summarize(dump: dict[str, Any], rank: int) -> list[Point]:
    """``rank``'s place in each process group of its dump (point-to-point operations
    and malformed entries left out)."""
    newest: dict[str, dict[str, Any]] = {}
    completed: dict[str, int] = {}
    for entry in dump.get("entries") or []:
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue
        seq = entry.get("collective_seq_id")
        group = entry.get("process_group")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            continue
        if isinstance(group, list | tuple) and group:
            name = str(group[0])
            desc = str(group[1]) if len(group) > 1 else "undefined"
            pg = name if desc in ("undefined", "") else f"{name}:{desc}"
        else:
            pg = str(entry.get("pg_id", "?"))
        pg = pg[:64]
        if seq >= int(newest.get(pg, {}).get("collective_seq_id", -1)):
            newest[pg] = entry
        if entry.get("state") == "completed" or entry.get("retired") is True:
            completed[pg] = max(completed.get(pg, -1), seq)
    return [
        Point(
            rank=rank,
            pg=pg,
            seq=int(e["collective_seq_id"]),
            completed=completed.get(pg, -1),
            op=str(e.get("profiling_name") or "?")[:64],
            state=str(e.get("state") or "?")[:16],
        )
        for pg, e in sorted(newest.items())
    ]


@dataclass(frozen=True, slots=True)
class Verdict:
    rank: int
    pg: str
    kind: str  # "behind", "not started" or "mismatch": what the dumps show of it
    detail: str


def culprit(points: Iterable[Point]) -> Verdict | None:
    """The rank the gang waits for, from every rank's :class:`Point`\\ s; None when the
    dumps name no one (no process group is stuck, or every rank is alike)."""
    by_pg: dict[str, dict[int, Point]] = {}
    for p in points:
        by_pg.setdefault(p.pg, {})[p.rank] = p
    found = [v for pg, ranks in sorted(by_pg.items()) if (v := _stuck(pg, ranks)) is not None]
    if not found:
        return None
    # Evidence of a rank behind the others first (the plainest), then a start, then a mismatch.
    return min(found, key=lambda v: _KINDS.index(v.kind))


_KINDS: Final = ("behind", "not started", "mismatch")


def _stuck(pg: str, ranks: dict[int, Point]) -> Verdict | None:
    if len(ranks) < 2:
        return None
    top = max(p.seq for p in ranks.values())
    waiting = sorted(r for r, p in ranks.items() if p.seq == top and p.completed < top)
    if not waiting:
        return None  # its newest collective completed everywhere it was entered
    at = ranks[waiting[0]]
    behind = [p for p in ranks.values() if p.seq < top]
    if behind:
        worst = min(behind, key=lambda p: (p.seq, p.rank))
        return Verdict(
            worst.rank,
            pg,
            "behind",
            f"rank {worst.rank} never entered collective #{top} ({at.op}) of process "
            f"group {pg}, in which rank{_s(waiting)} {_list(waiting)} "
            f"wait{'' if len(waiting) > 1 else 's'}; its newest is #{worst.seq} ({worst.op})",
        )
    states = {r: p.state for r, p in ranks.items()}
    if "started" in states.values():
        late = sorted(r for r, s in states.items() if s == "scheduled")
        if late:
            return Verdict(
                late[0],
                pg,
                "not started",
                f"rank {late[0]}'s collective #{top} ({at.op}) of process group {pg} "
                "never started on its GPU, while the others' did",
            )
    ops = Counter(p.op for p in ranks.values())
    if len(ops) > 1:
        common, count = ops.most_common(1)[0]
        if count * 2 > len(ranks):
            odd = min(r for r, p in ranks.items() if p.op != common)
            return Verdict(
                odd,
                pg,
                "mismatch",
                f"rank {odd} entered {ranks[odd].op} as collective #{top} of process "
                f"group {pg}, the others {common}",
            )
    return None


def _s(ranks: Sequence[int]) -> str:
    return "s" if len(ranks) > 1 else ""


def _list(ranks: Sequence[int], most: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    return shown + (f" and {len(ranks) - most} more" if len(ranks) > most else "")
