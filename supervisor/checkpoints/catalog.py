"""The checkpoint catalog: which steps of a job are committed at which tier.

Agents report every shard that lands at (or is deleted from) a tier
(``CkptLanding``). A step is *committed* at a tier once every rank of the job
has a shard there, each checked against its seal by the agent that stored it;
the catalog (in the supervisor's SQLite store) then records the commit and
one ``CkptCatalog`` per node of the job is published, retained, on
``phalanx/v1/job/JOB/ckpt/NODE``.
Agents write the step's manifest at their tiers and apply retention when
they see it, and answer their ranks' restores from it. A deletion (retention)
removes the step at that tier from the catalog; so does a rank's report that its
copy there is corrupt or gone. ``gang_restore`` picks the one step the whole gang
restores from.

``pick_buddies`` chooses each node's peer-tier buddy: a pure function.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from phalanx import wire
from supervisor.checkpoints.rows import CkptQueries, CkptRows, ShardRow
from supervisor.store import Store

log = logging.getLogger(__name__)

_NO_STEPS = b'"steps":[]'  # in a catalog's payload, its steps field empty (wire.encode)
DROPPED_KEPT = 4096  # the steps retention dropped that the catalog remembers (~a job's 1,000)


def pick_buddies(nodes: Sequence[str], racks: Mapping[str, str]) -> dict[str, str]:
    """Each node's buddy: another node of the gang, in another rack where one exists.

    The nodes are ordered rack by rack and each node's buddy is the next one in
    the ring, shifted by half a ring when that lands in another rack: with two
    racks or more, every copy leaves its rack; no node holds more than one
    other node's copies. A gang of one node has no buddy.
    """
    if len(nodes) < 2:
        return {}
    ring = sorted(nodes, key=lambda n: (racks.get(n, ""), n))
    size = len(ring)
    # The ring holds each rack as one block; the pairs (i, i + shift) that stay in a
    # block of b nodes number max(0, b - shift), plus max(0, b - size + shift) across
    # the ring's end. Counted per rack, not per node: a 2,048-node gang without rack
    # labels took seconds per order when every shift was tried node by node (issue 22).
    blocks = sorted(
        (len(list(group)) for _, group in itertools.groupby(ring, lambda n: racks.get(n, ""))),
        reverse=True,
    )

    def staying(shift: int) -> int:
        stay, least = 0, min(shift, size - shift)
        for b in blocks:  # largest first: a block no larger than ``least`` keeps none
            if b <= least:
                break
            stay += max(0, b - shift) + max(0, b - size + shift)
        return stay

    best, fewest = 1, size + 1
    for shift in range(1, size):  # the first shift that moves the most copies off their rack
        stay = staying(shift)
        if stay < fewest:
            best, fewest = shift, stay
            if stay == 0:
                break
    return {ring[i]: ring[(i + best) % size] for i in range(size)}


@dataclass(frozen=True, slots=True)
class GangRestore:
    """The step the whole gang restores from (None: none readable), why none is, and the
    ranks that read another rank's shard of it (rank -> saved rank: an elastic gang of
    another size than the one that saved it)."""

    step: int | None
    note: str = ""
    sources: Mapping[int, int] = field(default_factory=dict)


def gang_restore(
    committed: Mapping[int, Mapping[str, float]],
    where: Mapping[tuple[int, int, str], tuple[str, str | None]],
    world_size: int,
    placement: Mapping[int, str],
    alive: Set[str] | None,
    reachable: Set[str] | None = None,
    *,
    elastic: bool = False,
    sharded: bool = False,
) -> GangRestore:
    """The newest committed step every rank can read from where it runs, and why none
    is when none is.

    Rank ``r`` can read step ``s`` when ``s`` is committed at the object store; or at
    the peer tier and the buddy holding r's copy is alive; or at RAM or NVMe and r
    runs on the node that landed that copy, alive. A rank with no place in
    ``placement`` (the job is not running) is taken to run where it landed. With
    ``reachable`` (the nodes whose address is known), a buddy must be in it too.

    ``elastic``: the job's state is replicated and its size may change, so a step saved
    by another number of ranks than ``world_size`` is read through
    :func:`reshape_sources` (each rank reads some saved rank's shard).

    ``sharded``: the job's ranks each hold their own part of the state and reshard it
    themselves (``elastic.reshard``), so a rank of a gang of another size may read any
    saved rank's shard: such a step is readable when every node of the gang can read
    every saved shard (the object store's, a live buddy's copy, or one it landed).
    """
    saved_by: dict[int, set[int]] = {}
    if elastic or sharded:
        for s, r, _t in where:
            saved_by.setdefault(s, set()).add(r)
    gang_nodes: list[str | None] = [*sorted(set(placement.values()))] or [None]

    def readable(step: int, node: str | None, saved: int, tiers: Mapping[str, float]) -> bool:
        for tier in ("ram", "nvme", "peer"):
            if tier not in tiers or (step, saved, tier) not in where:
                continue
            landed, holder = where[(step, saved, tier)]
            at = holder if tier == "peer" else landed
            if at is None or (alive is not None and at not in alive):
                continue
            if tier == "peer" and reachable is not None and at not in reachable:
                continue  # the agent could not find the buddy holding it
            if tier == "peer" or node is None or node == landed:
                return True
        return False

    # Over the catalog's rows (a Where), who can read a step is found node by node, in
    # sets: at 16,384 ranks a rank-by-rank look at the newest step held the event loop
    # 0.05-0.15 s before a build's first message, and before a recovery's plan (issue 22).
    runs: dict[str, set[int]] | None = None
    unplaced: frozenset[int] = frozenset()
    if isinstance(where, Where):
        runs = {}
        for r, node in placement.items():
            runs.setdefault(node, set()).add(r)
        unplaced = frozenset(range(world_size)).difference(placement)

    note = ""
    for step in sorted(committed, reverse=True):
        tiers = committed[step]
        sources: dict[int, int] = {}
        saved = saved_by.get(step)
        resized = bool(saved) and saved != set(range(world_size))
        if resized and not sharded:
            sources = reshape_sources(step, committed, where, placement, alive, saved)
        if "object" in tiers:
            return GangRestore(step, "", _moved(sources))  # every shard in the shared store
        if resized and sharded:
            assert saved is not None
            cut = next(
                (
                    (node, s)
                    for s in sorted(saved)
                    for node in gang_nodes
                    if not readable(step, node, s, tiers)
                ),
                None,
            )
            if cut is None:
                return GangRestore(step)
            note = note or (
                f"node {cut[0] or '(none)'} can read no copy of saved rank {cut[1]}'s shard "
                f"of step {step} (saved by {len(saved)} ranks; a resharding gang may read "
                f"any of them; committed at {', '.join(sorted(tiers))})"
            )
            continue
        if runs is not None and not sources:
            assert isinstance(where, Where)
            ok = where.readable(step, tiers, runs, unplaced, alive, reachable)
            blocked = None if ok.issuperset(range(world_size)) else min(set(range(world_size)) - ok)
        else:
            blocked = next(
                (
                    r
                    for r in range(world_size)
                    if not readable(step, placement.get(r), sources.get(r, r), tiers)
                ),
                None,
            )
        if blocked is None:
            return GangRestore(step, "", _moved(sources))
        note = note or (
            f"rank {blocked} (on {placement.get(blocked) or 'no node'}) can read "
            f"no copy of step {step} (committed at {', '.join(sorted(tiers))})"
        )
    return GangRestore(None, note)


def _moved(sources: Mapping[int, int]) -> dict[int, int]:
    return {r: s for r, s in sources.items() if r != s}


def reshape_sources(
    step: int,
    committed: Mapping[int, Mapping[str, float]],
    where: Mapping[tuple[int, int, str], tuple[str, str | None]],
    placement: Mapping[int, str],
    alive: Set[str] | None,
    saved_ranks: Set[int] | None = None,
) -> dict[int, int]:
    """For a gang of another size than the one that saved ``step`` (replicated state, so
    any rank's shard restores any rank): rank -> the saved rank whose shard it reads.

    A rank reads a shard its own node saved (RAM, NVMe) where one is left, its own
    rank's first; the others take the shards left, in rank order, those a live buddy
    holds first; every saved shard at most once while there are enough (a gang that
    grew reads some twice). ``alive``: the nodes not offline (None: all);
    ``saved_ranks``: the ranks that saved ``step``, when the caller has them (else found
    in ``where``, a scan of every shard)."""
    saved = sorted(
        saved_ranks if saved_ranks is not None else {r for (s, r, _t) in where if s == step}
    )
    if not saved:
        return {}
    tiers = committed.get(step, {})
    local: dict[str, list[int]] = {}
    for r in saved:
        for tier in ("ram", "nvme"):
            if tier in tiers and (step, r, tier) in where:
                node = where[(step, r, tier)][0]
                if (alive is None or node in alive) and r not in local.get(node, []):
                    local.setdefault(node, []).append(r)
    used: set[int] = set()
    out: dict[int, int] = {}
    for rank in sorted(placement):
        mine = [r for r in local.get(placement[rank], []) if r not in used]
        if mine:
            out[rank] = rank if rank in mine else mine[0]
            used.add(out[rank])

    def held(r: int) -> int:
        peer = where.get((step, r, "peer"))
        up = peer is not None and (alive is None or peer[1] in alive)
        return 0 if "peer" in tiers and up else 1

    left = sorted((r for r in saved if r not in used), key=lambda r: (held(r), r))
    ranks = sorted(placement) or list(range(len(saved)))
    for rank in ranks:
        if rank not in out:
            out[rank] = left.pop(0) if left else saved[rank % len(saved)]
    return out


def guard_hold(committed: Iterable[int], reach: int) -> list[int]:
    """The committed steps the tiers below RAM keep beyond ``keep`` for the loss guard,
    whose ``reach`` is its window and margin: a spike found now must find a committed
    step at least that much older than the newest, and not a much older one.

    Holding that step alone would not do: the steps that were to take its place as the
    run goes on are deleted by ``keep`` first, and the held step only gets older. So the
    newest step of each of the three spans of ``reach / 2`` steps before the newest's
    span is held too (each was the newest when its span ended, so it is still there):
    one of them is always at least ``reach`` and at most about ``2 x reach`` older than
    the newest. Until a step is that old, the oldest committed is held. At most four
    steps, whatever the checkpoint interval (``tests/unit/supervisor/test_rollback.py``
    checks the guarantee over intervals, reaches and ``keep``)."""
    steps = sorted(set(committed))
    if not steps:
        return []
    newest = steps[-1]
    width = max(1, -(-reach // 2))
    span = newest // width
    held = {max((s for s in steps if s <= newest - reach), default=steps[0])}
    for back in (1, 2, 3):
        within = [s for s in steps if s // width == span - back]
        if within:
            held.add(within[-1])
    held.discard(newest)
    return sorted(held)


class StepRows:
    """The shards of one committed (step, tier): rank -> (node, holder, nbytes, checksum),
    and which ranks each node landed. Read once from the store and kept while the store
    says (``Store.shard_versions``) nothing of that step and tier was written since: a
    catalog build reads only the steps committed since the last build."""

    __slots__ = ("_by_holder", "_by_node", "by_rank")

    def __init__(self, by_rank: Mapping[int, ShardRow]) -> None:
        self.by_rank = by_rank
        self._by_node: dict[str, frozenset[int]] | None = None
        self._by_holder: dict[str, frozenset[int]] | None = None

    @property
    def by_node(self) -> Mapping[str, frozenset[int]]:
        if self._by_node is None:
            nodes: dict[str, set[int]] = {}
            for rank, row in self.by_rank.items():
                nodes.setdefault(row[0], set()).add(rank)
            self._by_node = {node: frozenset(ranks) for node, ranks in nodes.items()}
        return self._by_node

    @property
    def by_holder(self) -> Mapping[str, frozenset[int]]:
        """Which ranks' copies each holder keeps (the peer tier's buddies)."""
        if self._by_holder is None:
            holders: dict[str, set[int]] = {}
            for rank, row in self.by_rank.items():
                if row[1] is not None:
                    holders.setdefault(row[1], set()).add(rank)
            self._by_holder = {holder: frozenset(ranks) for holder, ranks in holders.items()}
        return self._by_holder


Rows = dict[tuple[int, str], StepRows]  # (step, tier) -> its shards


class Where(Mapping[tuple[int, int, str], tuple[str, str | None]]):
    """(step, rank, tier) -> (node that landed it, holder), over the committed rows: what
    :func:`gang_restore` reads, without a dict of every shard of the job."""

    def __init__(self, rows: Mapping[tuple[int, str], StepRows]) -> None:
        self._rows = rows

    def __getitem__(self, key: tuple[int, int, str]) -> tuple[str, str | None]:
        step, rank, tier = key
        found = self._rows.get((step, tier))
        if found is None or rank not in found.by_rank:
            raise KeyError(key)
        row = found.by_rank[rank]
        return row[0], row[1]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 3:
            return False
        found = self._rows.get((key[0], key[2]))
        return found is not None and key[1] in found.by_rank

    def readable(
        self,
        step: int,
        tiers: Mapping[str, float],
        runs: Mapping[str, Set[int]],
        unplaced: Set[int],
        alive: Set[str] | None,
        reachable: Set[str] | None,
    ) -> set[int]:
        """The ranks that can read their own shard of ``step`` (committed at ``tiers``) at
        a tier below the object store, as :func:`gang_restore` reads one rank's: a RAM or
        NVMe copy a live node landed, read by a rank that runs there (``runs``: node ->
        its ranks) or runs nowhere (``unplaced``); a peer copy a live buddy holds, that
        is ``reachable`` (None: all)."""
        ok: set[int] = set()
        for tier in ("ram", "nvme"):
            rows = self._rows.get((step, tier)) if tier in tiers else None
            if rows is None:
                continue
            for node, landed in rows.by_node.items():
                if alive is not None and node not in alive:
                    continue
                here = runs.get(node)
                if here:
                    ok |= landed & here
                if unplaced:
                    ok |= landed & unplaced
        rows = self._rows.get((step, "peer")) if "peer" in tiers else None
        if rows is not None:
            for holder, held in rows.by_holder.items():
                if (alive is None or holder in alive) and (
                    reachable is None or holder in reachable
                ):
                    ok |= held
        return ok

    def __iter__(self) -> Iterator[tuple[int, int, str]]:
        for (step, tier), found in self._rows.items():
            for rank in found.by_rank:
                yield step, rank, tier

    def __len__(self) -> int:
        return sum(len(found.by_rank) for found in self._rows.values())


class _Listed:
    """One step as a build listed it for one node, and what that listing was made of:
    the node's ranks, the rows of each of the step's committed tiers (a tier's rows are
    the same object while the store wrote nothing of that step and tier; a commit or a
    drop there is a write, and so is a change of its commit time), the peers' addresses
    and the credentials."""

    __slots__ = ("_json", "credential", "peers", "ranks", "rows", "step")

    def __init__(
        self,
        ranks: tuple[int, ...],
        rows: tuple[StepRows, ...],
        peers: Mapping[str, wire.PeerAddr],
        credential: Callable[[str, str], str | None] | None,
        step: wire.CkptStep,
    ) -> None:
        self.ranks = ranks
        self.rows = rows
        self.peers = peers
        self.credential = credential
        self.step = step
        self._json: bytes | None = None

    @property
    def json(self) -> bytes:
        """The step as the wire encodes it, encoded once for every build that lists it."""
        if self._json is None:
            self._json = wire.encode(self.step)
        return self._json

    def same(
        self,
        ranks: tuple[int, ...],
        rows: tuple[StepRows, ...],
        peers: Mapping[str, wire.PeerAddr],
        credential: Callable[[str, str], str | None] | None,
    ) -> bool:
        return (
            self.peers is peers
            and self.credential == credential
            and len(self.rows) == len(rows)
            and all(a is b for a, b in zip(self.rows, rows, strict=True))
            and self.ranks == ranks
        )


class CheckpointCatalog:
    def __init__(self, store: Store, *, term: int = 0) -> None:
        self.store = store
        self.rows = CkptRows.of(store)  # its tables: shards, commits, ended catalogs
        self.term = term  # the supervisor's leadership term, in every catalog (wire)
        # The committed rows read by earlier builds, and the version each was read at:
        # (job, step, tier) -> (version, rows). Written on the event loop only.
        self._rows: dict[tuple[str, int, str], tuple[int, StepRows]] = {}
        # The wire shards the last build of each job made, reused by the next (most of a
        # job's steps are the same from one build to the next).
        self._shards: dict[str, dict[tuple[Any, ...], wire.CkptShard]] = {}
        # job -> (node, step) -> a step as the last build listed it for that node, and what
        # it was made of (:class:`_Listed`)
        self._listed: dict[str, dict[tuple[str, int], _Listed]] = {}
        # The ranks landed so far of each step not yet committed at a tier, loaded from the
        # store once: counting them in SQL on every landing grew with the square of the ranks.
        # The generation that counts for each step and tier: the newest that landed there.
        # And every shard row of it, as the store holds them (rank -> row): at its commit
        # they are the committed rows, cached for the catalog's build, which read 16,384
        # of them back at every commit of a 2,048-node job (0.2-0.4 s of the event loop
        # on a busy host, between the last landing and the catalogs: issue 22). Last, the
        # key's version (``CkptRows.shard_versions``) after the catalog's own last read or
        # write of it: another, behind its back (a rollback's or the SDC watch's drop),
        # and the key is read again.
        self._landed: dict[
            tuple[str, int, str], tuple[int, set[int], dict[int, ShardRow], int | None]
        ] = {}
        # The (job, step, tier) retention dropped last, oldest first: every rank reports
        # its deletion, and all but the first found nothing left to delete, two
        # statements each (131,072 at 2,048 nodes a checkpoint). Landed again, a key
        # leaves it; a rollback empties it.
        self._dropped: dict[tuple[str, int, str], None] = {}
        store.on_rollback(self._dropped.clear)

    def on_landing(self, msg: wire.CkptLanding, world_size: int) -> bool:
        """Record a landing or deletion; True when a commit appeared or went."""
        if msg.event == "failed":
            self.store.add_event(
                "ckpt_failed",
                msg.node,
                {
                    "job": msg.job,
                    "step": msg.step,
                    "rank": msg.rank,
                    "tier": msg.tier,
                    "error": msg.error,
                },
            )
            return False
        if msg.event == "corrupt":
            # A rank could not use this copy: the step is no longer whole at that tier.
            self.store.add_event(
                "ckpt_corrupt",
                msg.node,
                {
                    "job": msg.job,
                    "step": msg.step,
                    "rank": msg.rank,
                    "tier": msg.tier,
                    "error": msg.error,
                },
            )
            log.warning(
                "job %s: rank %d found its copy of step %d at tier %s unusable: %s",
                msg.job,
                msg.rank,
                msg.step,
                msg.tier,
                msg.error,
            )
            self._landed.pop((msg.job, msg.step, msg.tier), None)
            return self.rows.drop_shard(msg.job, msg.step, msg.tier, msg.rank)
        key = (msg.job, msg.step, msg.tier)
        if msg.event == "deleted":
            # Retention is the same on every node, and one agent's deletion at a shared
            # tier (the object store) removes every rank's shard: the step is gone there.
            self._landed.pop(key, None)
            if key in self._dropped:
                return False  # another rank's report of a step already dropped there
            went = self.rows.retire_step(msg.job, msg.step, msg.tier)  # rows deleted soon
            self._dropped[key] = None
            if len(self._dropped) > DROPPED_KEPT:
                del self._dropped[next(iter(self._dropped))]
            return went
        self._dropped.pop(key, None)  # landed again: it has rows
        saved: set[int] = set()
        if msg.event == "staged":
            # A copy of a save (a restore staged it in RAM): it counts with the shards of
            # the generation that saved those bytes, never as a save of its own.
            saved = self.rows.saved_in(msg.job, msg.step, msg.rank, msg.checksum)
            if not saved:
                log.info(
                    "job %s: ignored rank %d's staged copy of step %d at tier %s: no "
                    "save of it is known",
                    msg.job,
                    msg.rank,
                    msg.step,
                    msg.tier,
                )
                return False
        entry = self._landed.get(key)
        if entry is None or entry[3] != self.rows.shard_versions.get(key):
            found = self.rows.shard_rows_of(*key)
            newest = max((g for g, _ in found.values()), default=max(saved, default=msg.generation))
            entry = self._landed[key] = (
                newest,
                {r for r, (g, _) in found.items() if g == newest},
                {r: row for r, (_, row) in found.items()},
                self.rows.shard_version(*key),
            )
        generation, ranks, shard_rows, _ = entry
        went = False
        if saved:
            msg = msg.model_copy(
                update={
                    "event": "landed",
                    "generation": generation if generation in saved else max(saved),
                }
            )
        if msg.generation < generation:
            # An older generation's write-down, late, of a step a newer one saves again:
            # it must not make a commit of two generations' shards.
            log.info(
                "job %s: ignored rank %d's shard of step %d at tier %s from generation "
                "%d: generation %d saves that step now",
                msg.job,
                msg.rank,
                msg.step,
                msg.tier,
                msg.generation,
                generation,
            )
            return False
        if msg.generation > generation:
            # A newer generation saves this step again (it restored an older one): what the
            # older generation left at this tier is stale or overwritten, its commit too.
            went = any(s == msg.step and t == msg.tier for s, t, _ in self.rows.commits(msg.job))
            self.rows.drop_step(msg.job, msg.step, msg.tier)
            generation, ranks = msg.generation, set()
            shard_rows.clear()
        replaced = shard_rows.get(msg.rank)
        self.rows.add_shard(
            msg.job,
            msg.step,
            msg.tier,
            msg.rank,
            msg.node,
            msg.holder,
            msg.nbytes,
            msg.checksum,
            msg.at,
            msg.generation,
            replaces=replaced[0] if replaced is not None else None,
        )
        shard_rows[msg.rank] = (msg.node, msg.holder, msg.nbytes, msg.checksum)
        ranks.add(msg.rank)
        if len(ranks) < world_size:
            self._landed[key] = (generation, ranks, shard_rows, self.rows.shard_versions.get(key))
            return went
        del self._landed[key]  # complete: a redelivery or a corrupt report reloads it
        for older in [
            k for k in self._landed if k[0] == msg.job and k[2] == msg.tier and k[1] < msg.step
        ]:
            del self._landed[older]  # most likely never complete; reloaded if it does
        if not self.rows.add_commit(msg.job, msg.step, msg.tier, time.time()):
            return went
        # The committed rows, as the store now holds them, at the version the commit's
        # write gave the key: the next build reads none of them (a write of the key
        # since, or this transaction rolled back, and it reads them all: forget()).
        self._rows[key] = (self.rows.shard_version(*key), StepRows(shard_rows))
        self.store.add_event(
            "ckpt_committed", None, {"job": msg.job, "step": msg.step, "tier": msg.tier}
        )
        log.info(
            "job %s: step %d committed at tier %s",
            msg.job,
            msg.step,
            msg.tier,
            extra={"job": msg.job, "event": "ckpt_committed", "step": msg.step, "tier": msg.tier},
        )
        return True

    def forget(self) -> None:
        """Drop what is cached of the store (after a write was rolled back)."""
        self._landed.clear()
        self._rows.clear()
        self._dropped.clear()

    def forget_job(self, job: str) -> None:
        """Drop what is cached of one job (it ended); a later landing reloads it."""
        for key in [k for k in self._landed if k[0] == job]:
            del self._landed[key]
        for cached in [k for k in self._rows if k[0] == job]:
            del self._rows[cached]
        self._shards.pop(job, None)
        self._listed.pop(job, None)
        self.rows.forget_versions(job)

    def pin_rows(
        self, job: str, commits: Iterable[tuple[int, str, float]] | None = None
    ) -> tuple[dict[tuple[int, str], int], Rows]:
        """On the event loop, before a build: the version of each committed (step, tier)
        of ``job`` now, and the rows cached of those still current (the build reads the
        others). A committed key the store has no version of (a store opened again)
        gets one now: its rows as read from here on are that version's. ``commits``: the
        job's commits as the caller just read them (else read here)."""
        pinned: dict[tuple[int, str], int] = {}
        for step, tier, _at in self.rows.commits(job) if commits is None else commits:
            key = (job, step, tier)
            pinned[(step, tier)] = self.rows.shard_version(*key)
        rows: Rows = {}
        for (step, tier), version in pinned.items():
            cached = self._rows.get((job, step, tier))
            if cached is not None and cached[0] == version:
                rows[(step, tier)] = cached[1]
        return pinned, rows

    def committed_view(self, job: str) -> tuple[dict[int, dict[str, float]], Where]:
        """On the event loop: the job's committed steps (step -> tier -> commit time) and
        where each rank's shard of them lies, for the recovery planner. The rows cached
        serve; only those written since are read (a recovery of a 16,384-rank job read
        every shard of it on the event loop, twice, before its start orders)."""
        commits = self.rows.commits(job)
        committed: dict[int, dict[str, float]] = {}
        for step, tier, at in commits:
            committed.setdefault(step, {})[tier] = at
        pinned, rows = self.pin_rows(job, commits)
        missing = [key for key in pinned if key not in rows]
        for key, by_rank in self.rows.shard_rows(job, missing).items():
            rows[key] = StepRows(by_rank)
        self.keep_rows(job, pinned, rows)
        return committed, Where({key: rows[key] for key in pinned})

    def keep_rows(self, job: str, pinned: Mapping[tuple[int, str], int], rows: Rows) -> None:
        """On the event loop, after a build: keep the rows it read of each (step, tier)
        still at the version pinned before it (one written since is read again next
        time); forget the job's others (no longer committed)."""
        versions = self.rows.shard_versions
        # Not one cached since the pin (a commit's rows, :meth:`on_landing`): its version
        # is newer than any pinned, and the next pin checks it as any other.
        pinned_up_to = max(pinned.values(), default=0)
        for cached in [
            k
            for k, (version, _) in self._rows.items()
            if k[0] == job and (k[1], k[2]) not in rows and version <= pinned_up_to
        ]:
            del self._rows[cached]
        for (step, tier), found in rows.items():
            version = pinned.get((step, tier))
            current = versions.get((job, step, tier))
            if version is not None and current == version:
                self._rows[(job, step, tier)] = (version, found)
            elif (held := self._rows.get((job, step, tier))) and held[0] != current:
                del self._rows[(job, step, tier)]  # stale (a newer one cached meanwhile stays)

    def messages(self, job: str, world_size: int, **kwargs: Any) -> list[wire.CkptCatalog]:
        """Every message of :meth:`iter_messages` (the same arguments), at once."""
        return list(self.iter_messages(job, world_size, **kwargs))

    def iter_messages(self, job: str, world_size: int, **kwargs: Any) -> Iterator[wire.CkptCatalog]:
        """The job's catalog as each node needs it, one message per node (see
        :meth:`iter_payloads`, which takes the same arguments)."""
        for message, _listed in self._iter_built(job, world_size, **kwargs):
            yield message

    def iter_payloads(
        self, job: str, world_size: int, **kwargs: Any
    ) -> Iterator[tuple[wire.CkptCatalog, bytes]]:
        """Each message of :meth:`iter_messages` and its payload, ``wire.encode(message)``
        byte for byte. A step listed again as the last build listed it (all but the newest,
        at a commit) is not encoded again: its bytes are spliced into the message's. At
        2,048 nodes a build encoded ~11 MB of catalogs, five steps a node, a quarter of
        its time (issue 22).

        The messages of one build differ only by their node, steps and ``sources``: the
        first one's envelope (the message without its steps) is the others', their node
        spliced in, where they have no ``sources`` (a message's copy and encoding each
        were a tenth of a 2,048-node build)."""
        template: tuple[bytes, bytes, bytes] | None = None  # before the node, after, tail
        for message, listed in self._iter_built(job, world_size, **kwargs):
            if not message.steps:
                yield message, wire.encode(message)
                continue
            steps = b",".join(
                wire.encode(step) if was is None else was.json
                for step, was in zip(message.steps, listed, strict=True)
            )
            node = message.node.encode()  # NodeId: ASCII letters, digits, "_.-"
            if template is None or message.sources:
                envelope = wire.encode(message.model_copy(update={"steps": []}))
                head, found, tail = envelope.partition(_NO_STEPS)
                if not found:  # cannot happen: the envelope has its steps field, empty
                    yield message, wire.encode(message)
                    continue
                named = b'"node":"' + node + b'"'
                if not message.sources and head.count(b'"node":"') == 1 and named in head:
                    before, _, after = head.partition(named)
                    template = (before + b'"node":"', b'"' + after + b'"steps":[', b"]" + tail)
                yield message, b"".join((head, b'"steps":[', steps, b"]", tail))
                continue
            yield message, b"".join((template[0], node, template[1], steps, template[2]))

    def _iter_built(
        self,
        job: str,
        world_size: int,
        *,
        generation: int = 0,
        placement: Mapping[int, str] | None = None,
        peers: Mapping[str, wire.PeerAddr] | None = None,
        alive: Set[str] | None = None,
        ended: bool = False,
        nodes: Sequence[str] = (),
        store: CkptQueries | None = None,
        credential: Callable[[str, str], str | None] | None = None,
        hold_steps: int | None = None,
        elastic: bool = False,
        sharded: bool = False,
        rows: Rows | None = None,
    ) -> Iterator[tuple[wire.CkptCatalog, list[_Listed | None]]]:
        """The job's catalog as each node needs it: one message per node that runs a rank
        of the job (``placement``: rank -> node, the current generation), landed a shard,
        or is named in ``nodes`` (the last generation's, when the job has ended).

        Every message lists the committed steps (the newest ``MAX_CATALOG_STEPS``, fewer
        when the node holds many ranks) and the shards of that node's ranks only, so
        its size does not grow with the job. ``peers`` gives the address of each node
        that can hold a peer copy; ``alive`` the nodes not offline (default: all).
        ``store``: where to read (default: the catalog's store).
        ``credential(holder, node)``: what ``node`` presents at ``holder``'s peer routes;
        each message's peer addresses carry its own node's credential only (none without
        ``credential``).
        ``hold_steps``: the loss guard's reach (its window and margin): every message's
        ``hold`` (:func:`guard_hold`), the steps retention keeps beyond ``keep``.
        ``elastic``: the job's state is replicated and its size may change; when the
        restore step was saved by another number of ranks, each node's message says
        which saved rank's shard each of its ranks restores (``sources``), and lists
        those shards. ``sharded``: the job's ranks reshard their state
        (``elastic.reshard``); when the restore step was saved by another number of ranks,
        every node's message lists every saved shard of it (a rank may read any).
        ``rows``: the committed rows known (:meth:`pin_rows`); the others are read from
        ``store`` and added, and what is no longer committed is taken out, so that the
        caller can keep them (:meth:`keep_rows`).

        Every read of ``store`` is done before the first message comes; then one message
        at a time, node by node, so that the caller may let other work run between them
        (the publisher builds on the event loop, in slices: a 2,048-node job's messages
        take about half a second of a core).
        """

        db = store if store is not None else self.rows
        placement = dict(placement or {})
        peers = peers if peers is not None else {}
        committed: dict[int, dict[str, float]] = {}
        for step, tier, at in db.commits(job):
            committed.setdefault(step, {})[tier] = at
        known: Rows = rows if rows is not None else {}
        wanted = [(step, tier) for step in committed for tier in committed[step]]
        missing = [key for key in wanted if key not in known]
        for key, by_rank in db.shard_rows(job, missing).items():
            known[key] = StepRows(by_rank)
        committed_rows = {key: known[key] for key in wanted}
        for key in [k for k in known if k not in committed_rows]:
            del known[key]  # no longer committed: the caller keeps what is
        where = Where(committed_rows)
        # Which ranks each node landed, found node by node as its message is built (all at
        # once, before the first, it held the event loop ~30 ms at 2,048 nodes).
        by_nodes = [step_rows.by_node for step_rows in committed_rows.values()]
        landed_nodes: set[str] = set().union(*by_nodes)

        def landed_on(node: str) -> set[int]:
            ranks: set[int] = set()
            for by_node in by_nodes:
                landed = by_node.get(node)
                if landed:
                    ranks |= landed
            return ranks

        # Each step's tiers by name: a rank's shard is listed from the first that has it.
        by_tier = {
            step: [committed_rows[(step, tier)].by_rank for tier in sorted(tiers)]
            for step, tiers in committed.items()
        }

        def shard(step: int, rank: int) -> ShardRow | None:
            for by_rank in by_tier[step]:
                row = by_rank.get(rank)
                if row is not None:
                    return row
            return None

        def saved_ranks(step: int) -> int:
            ranks: set[int] = set()
            for tier in committed[step]:
                ranks.update(committed_rows[(step, tier)].by_rank)
            return len(ranks)

        found = gang_restore(
            committed,
            where,
            world_size,
            placement,
            alive,
            set(peers) if peers else None,
            elastic=elastic,
            sharded=sharded,
        )
        restore_step, note, sources = found.step, found.note, found.sources
        # A resharding gang of another size than the restore step's: any node's ranks may
        # read any saved shard of it.
        every: set[int] = set()
        if sharded and restore_step is not None:
            for tier in committed[restore_step]:
                every.update(committed_rows[(restore_step, tier)].by_rank)
            if every == set(range(world_size)):
                every = set()
        if not committed and db.ever_committed(job):
            # A rank must not start afresh while its peers would have restored.
            note = (
                "every step the job committed is gone from the catalog (deleted, or "
                "reported corrupt or unreadable): nothing the whole gang can restore"
            )
        held = guard_hold(committed, hold_steps) if hold_steps is not None else []
        # (holder, node) -> where holder listens with node's credential there, and what
        # tells that address apart in ``made``
        addresses: dict[tuple[str, str], tuple[wire.PeerAddr | None, tuple[Any, ...] | None]] = {}

        def addressed(holder: str, node: str) -> tuple[wire.PeerAddr | None, Any]:
            key = (holder, node)
            found = addresses.get(key)
            if found is None:
                addr = peers.get(holder)
                token = credential(holder, node) if credential and addr else None
                if addr is not None and token is not None:
                    addr = addr.model_copy(update={"token": SecretStr(token)})
                said = None if addr is None else (addr.node, addr.address, addr.http_port, token)
                found = addresses[key] = (addr, said)
            return found

        # The wire shards of the last build, by what they say: most are the same again.
        before = self._shards.get(job, {})
        made: dict[tuple[Any, ...], wire.CkptShard] = {}
        no_peer: tuple[None, None] = (None, None)

        def wire_shard(
            rank: int, row: ShardRow, peer: tuple[wire.PeerAddr | None, Any]
        ) -> wire.CkptShard:
            key = (rank, row[3], row[2], peer[1])
            got = made.get(key) or before.get(key)
            if got is None:
                got = wire.CkptShard(rank=rank, checksum=row[3], nbytes=row[2], peer=peer[0])
            made[key] = got
            return got

        # A step listed for a node by the last build is listed again as it was while what
        # it is made of stands: the node's ranks, the same rows of each of the step's tiers
        # (kept while the store wrote nothing of them, :meth:`keep_rows`), its commit
        # times, the same peers and credentials. At a commit every node's message changes,
        # but only by its newest step: a 2,048-node build listed the older ones again
        # shard by shard (issue 22). Not for a job that reshapes (a step's listing there
        # depends on the restore step's sources and sizes).
        reuse = not (elastic or sharded)
        listed_before = self._listed.get(job, {}) if reuse else {}
        listed_now: dict[tuple[str, int], _Listed] = {}
        tier_rows = {
            step: tuple(committed_rows[(step, tier)] for tier in sorted(tiers))
            for step, tiers in committed.items()
        }

        runs: dict[str, set[int]] = {}
        for rank, node in placement.items():
            runs.setdefault(node, set()).add(rank)
        for node in sorted(set(runs) | landed_nodes | db.shard_nodes(job) | set(nodes)):
            mine = runs.get(node, set())
            read = {sources.get(r, r) for r in mine} if sources else set()
            ranks = sorted(mine | landed_on(node) | read)
            ranks_key = tuple(ranks)
            # ~200 bytes per shard listed: stay well under the wire's payload limit.
            budget = wire.MAX_PAYLOAD_BYTES // 2 - 256 * len(every)
            fit = max(1, budget // (200 * max(1, len(ranks)) + 100))
            keep = sorted(committed)[-min(wire.MAX_CATALOG_STEPS, fit) :]
            if restore_step is not None and restore_step not in keep:
                keep = sorted([restore_step, *keep[1:]])  # the gang's step is always listed
            steps = []
            listings: list[_Listed | None] = []  # each step's listing, where it is kept
            for step in keep:
                if reuse:
                    was = listed_before.get((node, step))
                    if was is not None and was.same(ranks_key, tier_rows[step], peers, credential):
                        steps.append(was.step)
                        listings.append(was)
                        listed_now[(node, step)] = was
                        continue
                listed = []
                peer_rows = committed_rows.get((step, "peer"))
                for rank in sorted(every | set(ranks)) if every and step == restore_step else ranks:
                    row = shard(step, rank)
                    if row is None:
                        continue
                    held_by = peer_rows.by_rank.get(rank) if peer_rows is not None else None
                    holder = held_by[1] if held_by is not None else None
                    listed.append(
                        wire_shard(rank, row, addressed(holder, node) if holder else no_peer)
                    )
                saved = saved_ranks(step) if elastic or sharded else world_size
                made_step = wire.CkptStep(
                    step=step,
                    committed=committed[step],
                    shards=listed,
                    # an elastic or resharding job's only: a step of another job
                    # with a copy gone (reported corrupt) was saved by the whole gang
                    world_size=saved if saved != world_size else None,
                )
                steps.append(made_step)
                if reuse:
                    listed_now[(node, step)] = now = _Listed(
                        ranks_key, tier_rows[step], peers, credential, made_step
                    )
                    listings.append(now)
                else:
                    listings.append(None)
            yield (
                wire.CkptCatalog(
                    job=job,
                    node=node,
                    world_size=world_size,
                    generation=generation,
                    term=self.term,
                    steps=steps,
                    restore_step=restore_step,
                    restore_note=note,
                    hold=held,
                    ended=ended,
                    sources={r: sources[r] for r in sorted(mine) if r in sources},
                ),
                listings,
            )
        self._shards[job] = made
        self._listed[job] = listed_now

    def view(self, job: str, world_size: int, tiers: Sequence[str]) -> dict[str, Any]:
        """Every step with a shard anywhere: committed tiers, and partial ones (ranks there)."""
        steps: dict[int, dict[str, Any]] = {}
        for step, tier, rank, node, holder, nbytes, _checksum in self.rows.shards(job):
            entry = steps.setdefault(
                step, {"step": step, "committed": {}, "partial": {}, "bytes": {}, "where": {}}
            )
            entry["partial"][tier] = entry["partial"].get(tier, 0) + 1
            entry["bytes"][tier] = entry["bytes"].get(tier, 0) + nbytes
            entry["where"].setdefault(tier, {})[str(rank)] = holder or node
        for step, tier, at in self.rows.commits(job):
            if step in steps:
                steps[step]["committed"][tier] = at
                steps[step]["partial"].pop(tier, None)
        return {
            "job": job,
            "world_size": world_size,
            "tiers": list(tiers),
            "steps": [steps[s] for s in sorted(steps)],
        }
