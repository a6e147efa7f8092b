"""A rank's restore under Phalanx: the copy its agent's restore plan names, read here.

The agent answers with the one step the whole gang restores from and, for this rank,
the copies of it nearest first (``ckpt.protocol.Candidate``): a file the rank maps
itself (the RAM slot or the disk tier's file), or a copy at a remote tier (the peer's,
the object store's) that the agent stages in one of this rank's RAM slots or streams.
A copy that fails is logged, reported to the agent when it is proven bad, and the next
one tried; a rank with no readable copy of that step raises rather than restore another
step than its peers. ``Checkpointer.restore`` calls :func:`restore_via_agent`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from ckpt.errors import (
    AgentError,
    CheckpointError,
    FormatError,
    ShardCorrupt,
    ShardGone,
    ShardMismatch,
    ShardRef,
    TierError,
    UnsupportedVersion,
)
from ckpt.format import decode
from ckpt.protocol import Candidate, StageReply, TierName
from ckpt.ram import read_slot_view
from ckpt.remote import AgentClient, read_file
from ckpt.tiers import ShardKey

# Set to 1 by the supervisor for a job whose ranks reshard their state (the job spec's
# elastic.reshard; phalanx.elastic.ENV_RESHARD).
ENV_RESHARD = "PHALANX_RESHARD"

__all__ = ["Restored", "decode_slot", "restore_via_agent"]

log = logging.getLogger(__name__)


@dataclass
class Restored:
    step: int
    state: Any
    tier: str  # the tier the copy was read from
    fresh: list[str]  # the places of ``into`` that had no matching tensor (came back new)


def decode_slot(
    view: memoryview, expected: str | None, ref: ShardRef, into: object, fresh: list[str]
) -> Any:
    """Decode a shard in a RAM slot, copied out (the slot is reused by later saves)."""
    try:
        return decode(view, copy=True, expected=expected, ref=ref, into=into, fresh=fresh)
    finally:
        with contextlib.suppress(BufferError):
            view.release()


def restore_via_agent(
    agent: AgentClient,
    job: str,
    rank: int,
    step: int | None,
    into: object = None,
    *,
    timeout_s: float,
    stage: bool = True,
    exact: bool = False,
) -> Restored | None:
    """The step the agent's plan names (or ``step``), read from this rank's nearest good
    copy; None when the job has no committed step. ``timeout_s`` bounds each staging and
    each stream of a copy. ``stage=False``: a copy at a remote tier is streamed, never
    staged in a RAM slot (another rank's shard, read by a resharding rank).
    ``exact``: ``rank``'s own shard and no other (a resharding rank reads saved rank
    ``rank``); otherwise a job whose ranks reshard (``PHALANX_RESHARD``) refuses a step
    saved by another number of ranks, whose parts are not this rank's."""
    found = agent.restore_plan(step)
    if found.unavailable:
        # Committed steps exist but none this whole gang can read: starting from
        # scratch here would silently diverge from the other ranks.
        raise CheckpointError(
            f"no checkpoint to restore rank {rank} from: {found.unavailable}",
            ref=ShardRef(job=job, rank=rank),
        )
    world = agent.env.world_size
    for entry in found.steps:
        if exact and entry.rank is not None and entry.rank != rank:
            raise CheckpointError(
                f"the agent's plan reads saved rank {entry.rank}'s shard of step "
                f"{entry.step} for rank {rank}: an elastic job with replicated state; "
                "restore() reads the right one",
                ref=ShardRef(job=job, rank=rank),
            )
        saved = entry.world_size
        if not exact and os.environ.get(ENV_RESHARD) == "1" and saved not in (None, world):
            raise CheckpointError(
                f"step {entry.step} was saved by {saved} ranks and this gang has {world}: "
                "a job whose ranks reshard their state (elastic.reshard) restores with "
                "Checkpointer.saved_layout() and restore_shards(ranks)",
                ref=ShardRef(job=job, rank=rank),
            )
    last_error: CheckpointError | None = None
    for entry in found.steps:
        # Another rank's shard when an elastic gang changed size: read as that rank.
        saved = entry.rank if entry.rank is not None else rank
        key = ShardKey(job, entry.step, saved)
        agent = agent.as_rank(saved)
        for where in entry.candidates:
            tier = where.tier
            fresh: list[str] = []
            try:
                state = _read(agent, where, key, into, fresh, timeout_s, stage=stage)
                if state is None:
                    raise ShardGone(
                        f"the copy of step {key.step} at tier {tier} is gone",
                        ref=key.ref(where.path),
                    )
            except (
                ShardCorrupt,
                FormatError,
                ShardMismatch,
                ShardGone,
                TierError,
                AgentError,
                TimeoutError,
            ) as exc:
                last_error = (
                    exc
                    if isinstance(exc, CheckpointError)
                    else TierError(str(exc), tier=tier, ref=key.ref())
                )
                log.warning(
                    "restore of step %d rank %d from tier %s failed: %s",
                    key.step,
                    rank,
                    tier,
                    exc,
                )
                # Only a copy proven bad (it does not verify or parse, or a local file
                # is gone) is reported: the catalog then drops it. A network error or a
                # timeout says nothing about the copy.
                definite = (
                    isinstance(exc, ShardCorrupt | FormatError | ShardMismatch)
                    and not isinstance(exc, UnsupportedVersion)
                ) or (isinstance(exc, ShardGone) and where.path is not None)
                if definite:
                    with contextlib.suppress(CheckpointError, TimeoutError):
                        agent.report(key.step, tier, str(exc))
                continue
            return Restored(key.step, state[0], tier, fresh)
        # The agent names the one step the whole gang restores from: never fall back
        # to another on this rank's own.
        raise CheckpointError(
            f"rank {rank} has no readable copy of step {key.step} (tried "
            f"{', '.join(w.tier for w in entry.candidates) or 'no tier'}): "
            f"{last_error or 'no copy reachable from this node'}",
            ref=key.ref(),
        )
    return None


def _read(
    agent: AgentClient,
    where: Candidate,
    key: ShardKey,
    into: object,
    fresh: list[str],
    timeout_s: float,
    *,
    stage: bool = True,
) -> tuple[Any] | None:
    tier, expected, path = where.tier, where.checksum, where.path
    if path is not None:
        mm = read_file(path)
        if mm is None:
            return None
        try:
            if tier == "ram":
                view = read_slot_view(mm, key.step)
                if view is None:
                    return None
                state = decode_slot(view, expected, key.ref(path), into, fresh)
            else:
                state = decode(mm, expected=expected, ref=key.ref(path), into=into, fresh=fresh)
        finally:
            with contextlib.suppress(BufferError):  # tensors still view a disk map
                mm.close()
        return (state,)
    nbytes = where.nbytes
    if nbytes is None:
        raise AgentError(
            f"the agent's restore plan lists no size for step {key.step} at tier {tier}: "
            f"{nbytes!r}",
            ref=key.ref(),
        )
    staged = _stage(agent, tier, key, timeout_s) if stage else StageReply()
    if staged.gone:
        return None
    if staged.path:
        try:
            view = read_slot_view(agent.map_slot(staged.path), key.step)
        except OSError as exc:  # its file removed since (a /dev/shm cleaner): stream it
            log.warning(
                "cannot map the RAM slot %s the agent staged step %d in: %s",
                staged.path,
                key.step,
                exc,
            )
            view = None
        if view is not None:  # else reused since (not by this rank): stream it
            return (decode_slot(view, expected, key.ref(f"{tier}:"), into, fresh),)
    # One buffer of the catalog's size, filled as the body streams in; a longer body
    # is refused, never buffered.
    data = agent.fetch_shard(tier, key.step, nbytes, timeout=timeout_s)
    if data is None:
        return None
    return (decode(data, expected=expected, ref=key.ref(f"{tier}:"), into=into, fresh=fresh),)


def _stage(agent: AgentClient, tier: TierName, key: ShardKey, timeout_s: float) -> StageReply:
    """Ask the agent to read the copy into a free RAM slot of this rank's (see
    ``/v1/ckpt/stage``); nothing staged from an agent that does not know how (an older
    one during a rolling upgrade): the copy is streamed then."""
    try:
        return agent.stage(key.step, tier, timeout=timeout_s)
    except AgentError as exc:
        if exc.status != 404:  # the route itself is unknown (a 404 about a copy names
            raise  # its tier, and is a TierError)
        log.info(
            "the agent stages no copies in RAM (%s): streaming step %d from %s",
            exc,
            key.step,
            tier,
        )
        return StageReply()
