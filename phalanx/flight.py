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


MAX_SEQ: Final = 2**62  # a sequence number past this is garbage, not a collective


def _text(value: Any, default: str = "?") -> str:
    """A string or an int as text; anything else (a container, whose repr may be huge)
    is not read."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return default


def _seq(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_SEQ:
        return None
    return value


def summarize(dump: dict[str, Any], rank: int) -> list[Point]:
    """``rank``'s place in each process group of its dump (point-to-point operations
    and malformed entries left out; only strings and numbers are read)."""
    newest: dict[str, tuple[int, str, str]] = {}  # pg -> (seq, op, state)
    completed: dict[str, int] = {}
    for entry in dump.get("entries") or []:
        if not isinstance(entry, dict) or entry.get("is_p2p") is True:
            continue
        seq = _seq(entry.get("collective_seq_id"))
        if seq is None:
            continue
        group = entry.get("process_group")
        if isinstance(group, list | tuple) and group:
            name = _text(group[0])
            desc = _text(group[1], "undefined") if len(group) > 1 else "undefined"
            pg = name if desc in ("undefined", "") else f"{name}:{desc}"
        else:
            pg = _text(entry.get("pg_id"))
        pg = pg[:64]
        state = _text(entry.get("state"))[:16]
        if seq >= newest.get(pg, (-1, "", ""))[0]:
            newest[pg] = (seq, _text(entry.get("profiling_name"))[:64], state)
        if state == "completed" or entry.get("retired") is True:
            completed[pg] = max(completed.get(pg, -1), seq)
    return [
        Point(rank, pg, seq, completed.get(pg, -1), op, state)
        for pg, (seq, op, state) in sorted(newest.items())
    ]


@dataclass(frozen=True, slots=True)
class Verdict:
    rank: int
    pg: str
    kind: str  # "behind", "not started" or "mismatch": what the dumps show of it
    detail: str


def culprit(points: Iterable[Point]) -> Verdict | None:
    """The rank the gang waits for, from every rank's :class:`Point`\\ s; None when the
    dumps name no one (no process group is stuck, or every rank is alike).

    In each process group the stuck collective is the oldest one not completed
    everywhere (a rank may have enqueued later ones already: NCCL's are asynchronous);
    the ranks that never entered it are behind. A rank behind in one group may itself
    wait in another (a pipeline or tensor-parallel group): the culprit is a rank behind
    somewhere that waits nowhere, the furthest behind first."""
    by_pg: dict[str, dict[int, Point]] = {}
    for p in points:
        by_pg.setdefault(p.pg, {})[p.rank] = p
    found: list[Verdict] = []
    waiting_anywhere: set[int] = set()
    for pg, ranks in sorted(by_pg.items()):
        verdict, waiting = _stuck(pg, ranks)
        waiting_anywhere |= waiting
        if verdict is not None:
            found.append(verdict)
    if not found:
        return None
    free = [v for v in found if v.rank not in waiting_anywhere]
    return min(free or found, key=lambda v: _KINDS.index(v.kind))


_KINDS: Final = ("behind", "not started", "mismatch")


def _stuck(pg: str, ranks: dict[int, Point]) -> tuple[Verdict | None, set[int]]:
    """The group's verdict, and the ranks that wait in its stuck collective."""
    if len(ranks) < 2:
        return None, set()
    stuck = min(p.completed for p in ranks.values()) + 1
    waiting = sorted(r for r, p in ranks.items() if p.seq >= stuck)
    if not waiting:
        return None, set()  # every rank completed every collective it entered
    behind = [p for p in ranks.values() if p.seq < stuck]
    op = next((ranks[r].op for r in waiting if ranks[r].seq == stuck), "")
    named = f" ({op})" if op and op != "?" else ""
    if behind:
        worst = min(behind, key=lambda p: (p.seq, p.rank))
        verb = "wait" if len(waiting) > 1 else "waits"
        return (
            Verdict(
                worst.rank,
                pg,
                "behind",
                f"rank {worst.rank} never entered collective #{stuck}{named} of process "
                f"group {pg}, in which rank{_s(waiting)} {_list(waiting)} {verb}; its "
                f"newest is #{worst.seq} ({worst.op})",
            ),
            set(waiting),
        )
    at = {r: p for r, p in ranks.items() if p.seq == stuck}  # newest is the stuck one
    if len(at) == len(ranks):
        states = {r: p.state for r, p in at.items()}
        late = sorted(r for r, s in states.items() if s == "scheduled")
        if late and "started" in states.values():
            return (
                Verdict(
                    late[0],
                    pg,
                    "not started",
                    f"rank {late[0]}'s collective #{stuck}{named} of process group {pg} "
                    "never started on its GPU, while the others' did",
                ),
                set(waiting),
            )
        ops = Counter(p.op for p in at.values())
        common, count = ops.most_common(1)[0]
        if len(ops) > 1 and count * 2 > len(at):
            odd = min(r for r, p in at.items() if p.op != common)
            return (
                Verdict(
                    odd,
                    pg,
                    "mismatch",
                    f"rank {odd} entered {at[odd].op} as collective #{stuck} of process "
                    f"group {pg}, the others {common}",
                ),
                set(waiting),
            )
    return None, set(waiting)


def _s(ranks: Sequence[int]) -> str:
    return "s" if len(ranks) > 1 else ""


def _list(ranks: Sequence[int], most: int = 8) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    return shown + (f" and {len(ranks) - most} more" if len(ranks) > most else "")


# --- read in a child process -------------------------------------------------------------

CHILD_MEMORY_BYTES: Final = 2 * 1024**3  # a dump's parse may use this much, no more
CHILD_TIMEOUT_S: Final = 20.0
MAX_POINTS_PER_RANK: Final = 8


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m phalanx.flight RANK=PATH ...``: the points of each dump, as one JSON
    list on stdout; a dump that cannot be read is named on stderr. The agent runs it in
    a child with its memory and time bounded (a dump is a file a rank wrote: a crafted
    one can ask for gigabytes, or for a string that takes hours to build)."""
    import json
    import sys

    out: list[dict[str, Any]] = []
    for arg in argv if argv is not None else sys.argv[1:]:
        rank_text, _, path = arg.partition("=")
        try:
            points = summarize(load(Path(path)), int(rank_text))
        except (DumpError, ValueError) as exc:
            print(f"flight recorder: {exc}", file=sys.stderr)
            continue
        # The groups stuck on this rank first, then the rest, at most a few per rank.
        points.sort(key=lambda p: (p.seq <= p.completed, p.pg))
        out.extend(vars_of(p) for p in points[:MAX_POINTS_PER_RANK])
    print(json.dumps(out))
    return 0


def vars_of(p: Point) -> dict[str, Any]:
    return {f: getattr(p, f) for f in Point.__slots__}


if __name__ == "__main__":
    raise SystemExit(main())
