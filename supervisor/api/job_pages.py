"""``GET /v1/jobs``'s query: filter the jobs by state and team, and page through them.

Pure, no I/O: the API hands it the jobs and the request's query. Without ``limit`` and
``before`` the answer is what it always was: every job that passes the filters, oldest
submitted first. With either, it is a page: newest submitted first, at most ``limit``
jobs (:data:`DEFAULT_LIMIT` when only ``before`` is given), and, when older jobs are
left, the cursor of the next page (the API sends it as ``X-Phalanx-Next``). A cursor
names a place in the order (submit time, job id), not a job: a page stays right while
jobs are submitted or end, and the jobs submitted since the first page are not on later
ones (poll the first page for those).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from supervisor.jobs import Job, JobState

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_TEAM = 200  # characters: longer is no team name


class PageQueryError(ValueError):
    """A bad query value; the message names the parameter."""


@dataclass(frozen=True)
class JobPage:
    jobs: list[Job]
    next: str | None  # the cursor of the next (older) page; None: no page is left
    total: int  # the jobs that pass the filters, on every page


def cursor_of(job: Job) -> str:
    """The cursor of the page after ``job``: the jobs submitted before it."""
    raw = json.dumps([job.submitted_at, job.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _place(cursor: str) -> tuple[float, str]:
    bad = PageQueryError("query 'before': not a cursor of this API (X-Phalanx-Next)")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        ts, job_id = json.loads(raw)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise bad from None
    if (
        not isinstance(ts, float | int)
        or isinstance(ts, bool)
        or not math.isfinite(ts)
        or not isinstance(job_id, str)
    ):
        raise bad
    return float(ts), job_id


def _states(value: str) -> set[JobState]:
    names = [s for s in value.split(",") if s]
    known = {s.value for s in JobState}
    bad = [s for s in names if s not in known]
    if bad or not names:
        raise PageQueryError(
            f"query 'state': a comma-separated list of {', '.join(s.value for s in JobState)}"
            + (f"; not one: {bad[0][:80]!r}" if bad else "")
        )
    return {JobState(s) for s in names}


def _limit(value: str) -> int:
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise PageQueryError(f"query 'limit': an integer from 1 to {MAX_LIMIT}")
    return limit


def page(jobs: Iterable[Job], query: Mapping[str, str]) -> JobPage:
    """The jobs ``query`` asks for (see the module doc); :class:`PageQueryError` names
    the first bad parameter."""
    states = _states(query["state"]) if "state" in query else None
    team = query.get("team")
    if team is not None and not 0 < len(team) <= MAX_TEAM:
        raise PageQueryError(f"query 'team': a team name of 1 to {MAX_TEAM} characters")
    limit = _limit(query["limit"]) if "limit" in query else None
    before = _place(query["before"]) if "before" in query else None
    found = [
        j
        for j in jobs
        if (states is None or j.state in states) and (team is None or j.spec.team == team)
    ]
    if limit is None and before is None:  # no paging: the answer of old
        return JobPage(sorted(found, key=lambda j: j.submitted_at), None, len(found))
    newest = sorted(found, key=lambda j: (j.submitted_at, j.id), reverse=True)
    if before is not None:
        newest = [j for j in newest if (j.submitted_at, j.id) < before]
    limit = limit or DEFAULT_LIMIT
    shown = newest[:limit]
    more = len(newest) > limit
    return JobPage(shown, cursor_of(shown[-1]) if more else None, len(found))
