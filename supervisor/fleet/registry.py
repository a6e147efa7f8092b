"""The node registry: births, heartbeats, deaths and drains become node states.

A node's state is derived from three facts, in this order:

* ``offline`` — no live link: its last will or shutdown arrived, or its
  heartbeats stopped for ``offline_after_s``, or the supervisor has not heard
  from it since it started;
* ``drain`` — an operator drained it, or its agent reported a ``drain``
  health reason (an automatic drain). An automatic drain is never lifted
  silently: the node stays drained after its health recovers, until an
  operator undrains it. Undraining a node whose health still says ``drain``
  is refused;
* ``warn`` — its agent reports a ``warn`` reason, or the supervisor gives it one of
  its own: its ranks straggle in several jobs at once (:meth:`Registry.mark_slow`);
* ``up`` — otherwise.

A node's reasons are its agent's and the supervisor's (:attr:`Node.reasons`). The
supervisor's come from the training metrics, which live in memory: they are not
persisted, and a restarted supervisor gives them again once the flags are seen again.

Every change of state, drain or health is recorded as an event and persisted,
so a restarted supervisor remembers drained nodes and why. What the fleet changes
(births, heartbeats, timeouts: thousands at once when a fleet connects) is written
soon, in one transaction (``Store.add_event_soon``); an operator's drain or undrain
is on disk before it is answered.
"""

from __future__ import annotations

import bisect
import enum
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from phalanx import wire
from supervisor.errors import Refused, RegistryError, UnknownNode
from supervisor.store import Event, Store
from supervisor.telemetry.slow_nodes import SlowNode

log = logging.getLogger(__name__)


# Nodes that go offline together (see Registry.mass_offline): at least this share of the
# fleet, and this many nodes, within this many seconds of each other. Seen at 2,048
# nodes (issue 22): a broker restart's wills reached the supervisor after it had
# reconnected, and 1,908 nodes of a job were quarantined.
MASS_OFFLINE_WINDOW_S = 10.0
MASS_OFFLINE_SHARE = 0.05
MASS_OFFLINE_MIN = 4
OFFLINE_HISTORY_S = 600.0  # how long a node going offline is remembered for that
# How long a rendezvous port handed out on a node is not handed out again: its rank 0
# binds it only once its ranks start (seconds; a cold start on a GPU node ~10 s).
PORT_REUSE_S = 120.0

# The gauges of a heartbeat as a node keeps them (:class:`Gauges`): each GPU's and the
# host's values in these fields' order, in plain tuples of numbers and strings.
GPU_GAUGES: Final = tuple(wire.GpuGauges.model_fields)
HOST_GAUGES: Final = tuple(wire.HostGauges.model_fields)


class Gauges(NamedTuple):
    """A node's gauges from its last heartbeat as plain tuples: ``gpus`` each GPU's
    :data:`GPU_GAUGES` values one GPU after the other (its throttle reasons a tuple),
    ``host`` the :data:`HOST_GAUGES` values. The cyclic garbage collector stops tracking
    a tuple of numbers and strings the first time it looks at it. Kept as the
    heartbeat's models, 2,048 nodes' gauges were ~85,000 tracked objects replaced every
    heartbeat, near half of what each young collection scanned (200-250 ms pauses on
    this 2-core machine: issue 22)."""

    sampled_at: float
    gpus: tuple[Any, ...]
    host: tuple[Any, ...] | None

    @classmethod
    def of(cls, health: wire.Health) -> Gauges:
        host = health.host
        return cls(
            health.sampled_at,
            tuple(
                v
                for g in health.gpus
                for v in (*(getattr(g, f) for f in GPU_GAUGES[:-1]), tuple(g.throttle))
            ),
            None if host is None else tuple(getattr(host, f) for f in HOST_GAUGES),
        )

    def gpu_dicts(self) -> list[dict[str, Any]]:
        """Each GPU's gauges as ``GpuGauges.model_dump()`` gives them."""
        n, gpus = len(GPU_GAUGES), self.gpus
        return [
            {
                **dict(zip(GPU_GAUGES, gpus[i : i + n], strict=True)),
                "throttle": list(gpus[i + n - 1]),
            }
            for i in range(0, len(gpus), n)
        ]

    def host_dict(self) -> dict[str, Any] | None:
        return None if self.host is None else dict(zip(HOST_GAUGES, self.host, strict=True))


NO_GAUGES: Final = Gauges(0.0, (), None)


class NodeState(enum.StrEnum):
    UP = "up"
    WARN = "warn"
    DRAIN = "drain"
    OFFLINE = "offline"


@dataclass
class Drain:
    by: str  # "operator", "auto" or "supervisor" (quarantine, failed burn-in)
    reason: str
    since: float
    codes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"by": self.by, "reason": self.reason, "since": self.since, "codes": self.codes}


@dataclass
class Node:
    id: str
    birth: wire.NodeBirth | None = None
    # Its agent's status and reasons; the gauges are in ``gauges`` (the same object
    # while neither changes: one heartbeat's models are not kept a second).
    health: wire.Health = field(default_factory=lambda: wire.Health(status=wire.HealthStatus.OK))
    gauges: Gauges = NO_GAUGES
    online: bool = False
    offline_cause: str = "not seen since the supervisor started"
    drain: Drain | None = None
    birth_seq: int = -1
    last_seen: float = 0.0  # time.monotonic() of the last birth or heartbeat
    last_seen_wall: float = 0.0
    offline_at: float = 0.0  # the registry's clock when it last went offline
    slow: SlowNode | None = None  # the supervisor's: its ranks straggle in several jobs
    # A port free on the node, from its last heartbeat, for the next launch's rendezvous
    # (``Registry.take_port``); the ports handed out there lately (port -> when), which
    # a heartbeat may name again before their rank 0 binds them: not handed out again.
    port: int | None = None
    ports_given: dict[int, float] = field(default_factory=dict)

    @property
    def state(self) -> NodeState:
        if not self.online:
            return NodeState.OFFLINE
        if self.drain is not None:
            return NodeState.DRAIN
        if self.health.status is wire.HealthStatus.WARN or self.slow is not None:
            return NodeState.WARN
        return NodeState.UP

    @property
    def reasons(self) -> list[wire.Reason]:
        """Its agent's health reasons, then the supervisor's own."""
        if self.slow is None:
            return list(self.health.reasons)
        return [*self.health.reasons, self.slow.reason()]

    _of_birth: tuple[wire.NodeBirth | None, dict[str, Any]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def _birth_view(self) -> dict[str, Any]:
        """What :meth:`view` shows of the birth, made once per birth (a fleet view of
        2,048 nodes dumped 16,384 GPU descriptors at every request: issue 22)."""
        b = self.birth
        cached = self._of_birth
        if cached is None or cached[0] is not b:
            cached = self._of_birth = (
                b,
                {
                    "rack": b.topology.rack if b else None,
                    "nvlink_domain": b.topology.nvlink_domain if b else None,
                    "hostname": b.hostname if b else None,
                    "address": b.address if b else None,
                    "http_port": b.http_port if b else None,
                    "gpu_backend": b.gpu_backend if b else None,
                    "version": b.version if b else None,
                    "gpu_count": len(b.gpus) if b else 0,
                    "gpus": [g.model_dump() for g in b.gpus] if b else [],
                },
            )
        return cached[1]

    def view(self) -> dict[str, Any]:
        """The node as the API and ``phalanx nodes -o json`` show it (stable keys)."""
        return {
            "id": self.id,
            "state": self.state.value,
            "health": self.health.status.value,
            **self._birth_view(),
            "reasons": [r.model_dump() for r in self.reasons],
            "drain": self.drain.as_dict() if self.drain else None,
            "offline_cause": None if self.online else self.offline_cause,
            "last_seen": self.last_seen_wall or None,
            "birth_seq": self.birth_seq,
        }

    def record(self) -> dict[str, Any]:
        return {
            "birth": self.birth.model_dump(mode="json") if self.birth else None,
            "health": self.health.model_dump(mode="json"),
            "drain": self.drain.as_dict() if self.drain else None,
            "birth_seq": self.birth_seq,
            "last_seen_wall": self.last_seen_wall,
        }

    @classmethod
    def from_record(cls, node_id: str, rec: dict[str, Any]) -> Node:
        node = cls(node_id)
        if rec.get("birth"):
            node.birth = wire.NodeBirth.model_validate(rec["birth"])
        if rec.get("health"):
            node.health = wire.Health.model_validate(rec["health"])
        if rec.get("drain"):
            node.drain = Drain(**rec["drain"])
        node.birth_seq = int(rec.get("birth_seq", -1))
        node.last_seen_wall = float(rec.get("last_seen_wall", 0.0))
        return node


class Registry:
    def __init__(
        self,
        store: Store,
        *,
        offline_after_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[Event], None] | None = None,
    ) -> None:
        self.store = store
        self.offline_after_s = offline_after_s
        self.clock = clock
        self.on_event = on_event
        self.nodes: dict[str, Node] = {
            node_id: Node.from_record(node_id, rec) for node_id, rec in store.load_nodes().items()
        }
        self.heartbeats = 0
        # Bumped whenever a node's state or its record (birth, drain, health, reasons)
        # changes: what the scheduler sees of the fleet is the same while it stands.
        self.version = 0
        self._went_offline: list[float] = []  # when nodes went offline, oldest first
        self._persisted: dict[str, tuple[object, ...]] = {}
        self._slow: set[str] = set()  # nodes with a ``slow`` reason

    # --- inbound ------------------------------------------------------------------

    def on_birth(self, birth: wire.NodeBirth) -> None:
        node = self.nodes.get(birth.node)
        if node is None:
            node = self.nodes[birth.node] = Node(birth.node)
            self._event("node_joined", node, rack=birth.topology.rack, gpus=len(birth.gpus))
        if birth.seq < node.birth_seq:
            log.info("ignored stale birth of %s (seq %d < %d)", node.id, birth.seq, node.birth_seq)
            return
        before = node.state
        node.birth, node.birth_seq = birth, birth.seq
        node.port = None  # a new agent process: its next heartbeat says what is free
        node.online = True
        self._seen(node)
        self._apply_health(node, birth.health, before)
        # Its health without the gauges: eight GpuGauges models a node, kept for the
        # birth's life (66,000 tracked objects at 2,048 nodes) for nothing.
        node.birth = birth.model_copy(update={"health": node.health})
        self._changed(node, before, cause="birth")

    def on_heartbeat(self, beat: wire.Heartbeat) -> bool:
        """False when the heartbeat cannot be placed (unknown node or stale birth)."""
        self.heartbeats += 1
        node = self.nodes.get(beat.node)
        if node is None or node.birth is None or beat.seq < node.birth_seq:
            return False
        if beat.seq > node.birth_seq:
            return False  # a birth we have not seen yet: ask for it
        before = node.state
        if not node.online:
            node.online = True
        given = node.ports_given.get(beat.port) if beat.port is not None else None
        fresh = given is None or self.clock() - given > PORT_REUSE_S
        node.port = beat.port if fresh else None
        self._seen(node)
        self._apply_health(node, beat.health, before)
        self._changed(node, before, cause="heartbeat")
        return True

    def take_port(self, node_id: str) -> int | None:
        """A port free on ``node_id`` at its last heartbeat, for a launch's rendezvous, or
        None (none known, the node offline, or that port handed out already): the launch
        asks the node then (``alloc_port``), a round trip behind everything the
        supervisor has yet to read (seconds, at 2,048 nodes, after a recovery's stops)."""
        node = self.nodes.get(node_id)
        if node is None or not node.online or node.port is None:
            return None
        port, node.port = node.port, None
        self.port_given(node_id, port)
        return port

    def port_given(self, node_id: str, port: int) -> None:
        """``port`` on ``node_id`` is a launch's rendezvous port now (taken from a
        heartbeat, or from the node's answer to ``alloc_port``): not handed out again
        for ``PORT_REUSE_S``, even if the node's heartbeats name it."""
        node = self.nodes.get(node_id)
        if node is None:
            return
        now = self.clock()
        given = node.ports_given
        for old in [p for p, at in given.items() if now - at > PORT_REUSE_S]:
            del given[old]
        given[port] = now
        if node.port == port:
            node.port = None

    def on_death(self, death: wire.NodeDeath) -> None:
        node = self.nodes.get(death.node)
        if node is None or death.seq < node.birth_seq or not node.online:
            return
        before = node.state
        node.online = False
        node.offline_at = self.clock()
        node.offline_cause = "clean shutdown" if death.cause == "shutdown" else "last will"
        self._changed(node, before, cause=node.offline_cause)

    def heard_all_now(self) -> None:
        """Count every online node as heard from now (the supervisor's own link to the
        broker was down: their silence meanwhile is not theirs)."""
        self.heard_now(self.nodes)

    def heard_now(self, ids: Iterable[str]) -> None:
        """Count these nodes, those online, as heard from now (the broker they were on
        was lost: they need a while to reach another)."""
        now = self.clock()
        for node_id in ids:
            node = self.nodes.get(node_id)
            if node is not None and node.online:
                node.last_seen = max(node.last_seen, now)

    def offline_together(self, at: float, window_s: float) -> int:
        """How many times a node went offline within ``window_s`` of ``at`` (registry
        clock), whether or not it is back since: the nodes that come back first do not
        make those still reconnecting a smaller event. Kept for ``OFFLINE_HISTORY_S``."""
        times = self._went_offline
        return bisect.bisect_right(times, at + window_s) - bisect.bisect_left(times, at - window_s)

    def mass_offline(self, node: Node) -> bool:
        """Whether ``node``, offline, went with many others (``MASS_OFFLINE_SHARE`` of the
        fleet, at least ``MASS_OFFLINE_MIN`` nodes, within ``MASS_OFFLINE_WINDOW_S``): a
        broker or network event more likely than that many failures."""
        return not node.online and self.mass_offline_at(node.offline_at)

    def mass_offline_at(self, offline_at: float) -> bool:
        """Whether many nodes went offline around ``offline_at`` (see :meth:`mass_offline`)."""
        together = self.offline_together(offline_at, MASS_OFFLINE_WINDOW_S)
        return together >= max(MASS_OFFLINE_MIN, MASS_OFFLINE_SHARE * len(self.nodes))

    def revive(self, since: float, only: Collection[str] | None = None) -> list[str]:
        """Nodes that went offline by their last will at or after ``since`` (the broker
        published it as it went down, not the node): online again, as heard now, so that
        they come back with a new birth or time out as usual. ``only``: of these nodes
        (those of one broker). Returns their ids."""
        now = self.clock()
        back = []
        for node in self.nodes.values():
            if only is not None and node.id not in only:
                continue
            if (
                not node.online
                and node.offline_cause == "last will"
                and node.offline_at >= since
                and node.birth is not None
            ):
                before = node.state
                node.online = True
                node.last_seen = now
                self._changed(node, before, cause="will sent as the broker went down")
                back.append(node.id)
        return back

    def check_timeouts(self, behind_s: float = 0.0) -> list[str]:
        """Mark nodes offline whose heartbeats stopped; returns their ids. ``behind_s``:
        how long the supervisor has had messages waiting that it has not handled yet (a
        node's heartbeat may be among them): that long more before a node times out."""
        now = self.clock()
        gone = []
        for node in self.nodes.values():
            if node.online and now - node.last_seen > self.offline_after_s + behind_s:
                before = node.state
                node.online = False
                node.offline_at = now
                node.offline_cause = f"no heartbeat for {now - node.last_seen:.1f}s"
                self._changed(node, before, cause="heartbeat timeout")
                gone.append(node.id)
        return gone

    def mark_slow(self, slow: Mapping[str, SlowNode]) -> list[str]:
        """The nodes slow now (:func:`supervisor.telemetry.slow_nodes.slow_nodes`), every other node
        not: gives or takes their ``straggler`` reason. Records ``node_slow`` when a node
        becomes slow or the jobs it is slow in change (not for a mere change of how much
        slower), ``node_slow_cleared`` when it is slow no more. Nodes the registry does not
        know are ignored. Returns the nodes whose state changed."""
        changed = []
        for node_id in sorted(self._slow | slow.keys()):
            node = self.nodes.get(node_id)
            if node is None:
                continue
            new, old = slow.get(node_id), node.slow
            if new is None and old is None:
                continue
            before = node.state
            node.slow = new
            if new is None and old is not None:
                self._event("node_slow_cleared", node, jobs=list(old.job_ids))
            elif new is not None and (old is None or old.job_ids != new.job_ids):
                self._event("node_slow", node, jobs=list(new.job_ids), reason=new.reason().detail)
            cause = "a straggler in several jobs" if new else "no longer a straggler"
            self._changed(node, before, cause=cause)
            if node.state is not before:
                changed.append(node_id)
        self._slow = {n for n in slow if n in self.nodes}
        return changed

    # --- operators ----------------------------------------------------------

    def get(self, node_id: str) -> Node:
        node = self.nodes.get(node_id)
        if node is None:
            raise UnknownNode(node_id)
        return node

    def drain(self, node_id: str, reason: str, *, by: str = "operator") -> Node:
        """Drain a node; ``by`` is "operator", or "supervisor" for a recovery's quarantine
        or a failed burn-in (lifted, like an operator's, only by an undrain)."""
        node = self.get(node_id)
        if not reason.strip():
            raise RegistryError("a drain needs a reason")
        before = node.state
        if node.drain is not None and node.drain.by == "auto":
            node.drain.reason = f"{node.drain.reason}; {by}: {reason}"
        else:
            node.drain = Drain(by=by, reason=reason, since=time.time())
        self._event("node_drained", node, by=by, reason=reason)
        self._changed(node, before, cause=f"{by} drain", quiet=True)
        self.store.flush()
        return node

    def undrain(self, node_id: str, *, force: bool = False) -> Node:
        node = self.get(node_id)
        if node.drain is None:
            raise Refused(f"node {node_id!r} is not drained")
        if node.health.status is wire.HealthStatus.DRAIN and not force:
            codes = ", ".join(r.code for r in node.health.reasons if r.severity == "drain")
            raise Refused(
                f"node {node_id!r} still reports drain reasons ({codes}); fix them "
                "first, or undrain with force"
            )
        before = node.state
        was = node.drain
        node.drain = None
        self._event("node_undrained", node, was_by=was.by, was_reason=was.reason, forced=force)
        self._changed(node, before, cause="operator undrain", quiet=True)
        self.store.flush()
        return node

    # --- internals ------------------------------------------------------------

    def _seen(self, node: Node) -> None:
        node.last_seen = self.clock()
        node.last_seen_wall = time.time()

    def _apply_health(self, node: Node, health: wire.Health, before: NodeState) -> None:
        old = node.health
        node.gauges = Gauges.of(health)
        if health.status != old.status or health.reasons != old.reasons:
            node.health = health.model_copy(update={"gpus": [], "host": None})
        health = node.health  # else the old object stays: no heartbeat's model is kept
        old_codes = sorted((r.code, -1 if r.gpu is None else r.gpu) for r in old.reasons)
        new_codes = sorted((r.code, -1 if r.gpu is None else r.gpu) for r in health.reasons)
        if old.status != health.status or old_codes != new_codes:
            self._event(
                "health_changed",
                node,
                status=health.status.value,
                reasons=[r.model_dump() for r in health.reasons],
            )
        if health.status is wire.HealthStatus.DRAIN:
            codes = sorted({r.code for r in health.reasons if r.severity == "drain"})
            if node.drain is None:
                detail = "; ".join(
                    f"{r.code}"
                    + (f" on GPU {r.gpu}" if r.gpu is not None else "")
                    + (f": {r.detail}" if r.detail else "")
                    for r in health.reasons
                    if r.severity == "drain"
                )
                node.drain = Drain(by="auto", reason=detail, since=time.time(), codes=codes)
                self._event("node_drained", node, by="auto", reason=detail, codes=codes)
            elif node.drain.by == "auto":
                node.drain.codes = sorted(set(node.drain.codes) | set(codes))

    def _changed(self, node: Node, before: NodeState, *, cause: str, quiet: bool = False) -> None:
        after = node.state
        if after is NodeState.OFFLINE and before is not NodeState.OFFLINE:
            went = self._went_offline
            if went and node.offline_at < went[-1]:
                bisect.insort(went, node.offline_at)
            else:
                went.append(node.offline_at)
            del went[: bisect.bisect_left(went, node.offline_at - OFFLINE_HISTORY_S)]
            if len(went) > 4 * len(self.nodes) + 64:  # a flapping fleet: the newest only
                del went[: len(went) - 4 * len(self.nodes) - 64]
        if after is not before and not quiet:
            self._event(
                "state_changed", node, state=after.value, previous=before.value, cause=cause
            )
        if after is not before:
            log.info(
                "node %s: %s -> %s (%s)",
                node.id,
                before.value,
                after.value,
                cause,
                extra={"node": node.id, "event": "node_state", "state": after.value},
            )
        if self._dirty(node, after, before):
            self.version += 1
            self.store.save_node_soon(node.id, node.record)

    def _dirty(self, node: Node, after: NodeState, before: NodeState) -> bool:
        # Persist on every state change and on anything that changed the record.
        key = (
            after,
            node.birth_seq,
            node.drain.as_dict() if node.drain else None,
            node.health.status,
            tuple((r.code, r.gpu) for r in node.health.reasons),
        )
        last = self._persisted.get(node.id)
        self._persisted[node.id] = key
        return last != key or after is not before

    def _event(self, kind: str, node: Node, **detail: Any) -> None:
        if self.on_event is None:
            self.store.add_event_soon(kind, node.id, detail)
            return
        self.on_event(self.store.add_event(kind, node.id, detail))
