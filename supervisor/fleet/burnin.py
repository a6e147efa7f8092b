"""Burn-in: a node is trusted with a failed node's ranks only after a short health test.

A node enters the spare pool, and a quarantined node returns to service after
an undrain, only once its agent's burn-in passes (``BurnInArgs``: on a GPU a
matmul and deterministic recompute check on every GPU, on the simulated backend a
fresh health sample and the simulated recompute check).
A node that fails it is drained with the reason, so it is neither a spare nor
schedulable until an operator looks at it. A pass holds until the node is
next drained, goes offline or is born again.

A burn-in that passes is screened too (``supervisor.fleet.screening``): the speed it
measured is compared with the nodes of the same GPU model that passed before, and a
node much slower than their median (a slow GPU, a degraded link between its GPUs)
fails like any other. Every node's figures are kept in memory for a day, for the
nodes that come after it (lost when the supervisor restarts or a standby takes over).

Links between nodes are probed too (``agentd.linkprobe``), both ways (in one command
where both agents announce ``wire.FEATURE_PROBE_BOTH_WAYS``, else two): a burn-in probes
the node's links with up to ``PROBE_TARGETS`` idle nodes, a node about to replace one
of a job's its link with a node of that job (:meth:`BurnIns.screen_join`, on the
recovery's path), and now and then two idle nodes probe each other
(:meth:`BurnIns.survey`), so that the fleet's median is known before it is needed. A
burn-in fails when the median of its links is far under the fleet's, judged only when it
probed that many nodes (one slow node among them is then not the new node's fault); a
replacement whose link to the job is slow, or does not carry at all, does not join.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from statistics import median
from typing import Any

from phalanx import wire
from phalanx.agent_tokens import AgentKeys
from phalanx.tasks import Tasks
from supervisor.errors import RegistryError
from supervisor.fleet.registry import NodeState, Registry
from supervisor.fleet.screening import Perf, parse_perf, screen, screen_p2p

log = logging.getLogger(__name__)

Sender = Callable[[str, wire.CommandArgsType, float], Awaitable[wire.CommandAck]]
# One way of a link probed: (MB/s, why not measured, whether the link failed).
Way = tuple[float | None, str, bool]
RETRY_S = 30.0  # a burn-in that could not run (no ack) is tried again after this
PERF_KEPT_S = 24 * 3600.0  # a node's speed counts in the fleet's median this long
PROBE_TARGETS = 3  # the idle nodes a burn-in reads from
PROBE_MAX_S = 2.0  # how long one probe reads at most
PROBE_COMMAND_S = PROBE_MAX_S + 10.0  # its command's timeout: the agent's connect (5 s) too
# A command that probes both ways (``ProbeLinkArgs.both_ways``): two reads' time.
PROBE_BOTH_WAYS_COMMAND_S = 2 * PROBE_COMMAND_S
# The longest a replacement's probes can take (two peers, both ways: one command each, or
# two for an agent from before ``both_ways``), for the recovery's deadline.
JOIN_PROBES_S = 2 * PROBE_BOTH_WAYS_COMMAND_S
ROUND_PROBES_S = PROBE_TARGETS * PROBE_BOTH_WAYS_COMMAND_S  # and a burn-in's
LINKS_KEPT = 4096  # the fleet's latest link figures
SURVEY_EARLY_S = 2.0  # between surveys while the fleet has too few link figures
SURVEY_S = 600.0  # between surveys after


@dataclass(frozen=True, slots=True)
class Screening:
    """How much slower than the fleet a node may be (``SupervisorSettings.screen_*``)."""

    max_slowdown: float = 0.05
    min_link: float = 0.5
    min_peers: int = 3
    probe_bytes: int = 32 << 20  # 0: no link probes
    min_p2p: float = 0.5


class BurnIns:
    def __init__(
        self,
        registry: Registry,
        send: Sender,
        *,
        timeout_s: float = 60.0,
        screening: Screening | None = None,
        agent_keys: AgentKeys | None = None,
        busy: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        """``busy``: the nodes whose ranks may be training now (no probe reads from them:
        the job's own traffic would be measured with it)."""
        self.registry = registry
        self._send = send
        self.timeout_s = timeout_s
        self.screening = screening or Screening()
        self._agent_keys = agent_keys if agent_keys is not None else AgentKeys("")
        self._busy = busy
        self._links: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=LINKS_KEPT
        )  # (when, MB/s): the links probed lately
        self._probed_from: dict[str, float] = {}  # node -> when it was last probed with
        self._surveying: asyncio.Task[Any] | None = None
        self._probe_locks: dict[str, asyncio.Lock] = {}  # node -> held while it probes
        self._surveyed_at = -float("inf")  # monotonic
        # node -> ((GPU model, GPU count), when, speed): every burn-in that measured one
        self._perf: dict[str, tuple[tuple[str, int], float, Perf]] = {}
        self._passed: dict[str, int] = {}  # node -> the birth seq it passed under
        self._passed_at: dict[str, float] = {}
        self._tasks = Tasks("burn-ins")
        self._running: dict[str, asyncio.Task[tuple[bool, str]]] = {}
        self._tried: dict[str, float] = {}  # node -> when its last burn-in could not run
        self._was_drained: set[str] = set()
        self._last_pass: dict[str, int] = {}  # node -> the birth seq of its last pass

    def passed(self, node_id: str) -> bool:
        node = self.registry.nodes.get(node_id)
        if node is None or node.birth is None or node.state in (NodeState.DRAIN, NodeState.OFFLINE):
            return False
        return self._passed.get(node_id) == node.birth.seq

    def passed_since(self, node_id: str, since: float) -> bool:
        return self.passed(node_id) and self._passed_at.get(node_id, 0.0) >= since

    def key(self) -> tuple[frozenset[str], frozenset[tuple[str, int]]]:
        """What :meth:`needs` answers from, besides the nodes' states and births: equal
        keys (and an unchanged registry) give equal answers."""
        return frozenset(self._was_drained), frozenset(self._passed.items())

    def needs(self, node_id: str) -> bool:
        """A node back from a drain that has not passed since: not schedulable yet."""
        return node_id in self._was_drained and not self.passed(node_id)

    def reinstated(self, node_id: str) -> None:
        """A recovery undrained ``node_id`` on a burn-in it passed while drained (a
        suspect's): that pass stands, unless the node was born again since."""
        node = self.registry.nodes.get(node_id)
        if node is None or node.birth is None or node.state in (NodeState.DRAIN, NodeState.OFFLINE):
            return
        if self._last_pass.get(node_id) == node.birth.seq:
            self._passed[node_id] = node.birth.seq
            self._was_drained.discard(node_id)

    def observe(self) -> list[str]:
        """Note the nodes drained or offline now (they burn in again when back); returns
        the undrained ones that need a burn-in before they take work again."""
        for known in self.registry.nodes.values():
            if known.state in (NodeState.DRAIN, NodeState.OFFLINE):
                self._passed.pop(known.id, None)
                if known.state is NodeState.DRAIN:
                    self._was_drained.add(known.id)
        return [
            n
            for n in sorted(self._was_drained)
            if not self.passed(n)
            and (node := self.registry.nodes.get(n)) is not None
            and node.state in (NodeState.UP, NodeState.WARN)
        ]

    def start(self, node_id: str) -> None:
        """Burn ``node_id`` in, in the background, unless it passed or is being tested."""
        if self.passed(node_id) or node_id in self._running:
            return
        if time.monotonic() - self._tried.get(node_id, -1e9) < RETRY_S:
            return
        task = self._tasks.spawn(self.run(node_id), name=f"burn-in-{node_id}")
        if task is None:
            return  # shutting down
        self._running[node_id] = task
        task.add_done_callback(lambda _t: self._running.pop(node_id, None))

    async def run(self, node_id: str) -> tuple[bool, str]:
        """Burn the node in now (or join the one running); (passed, why not)."""
        if self.passed(node_id):
            return True, ""
        running = self._running.get(node_id)
        if running is not None and running is not asyncio.current_task():
            return await asyncio.shield(running)
        node = self.registry.nodes.get(node_id)
        seq = node.birth.seq if node is not None and node.birth is not None else None
        try:
            ack = await self._send(node_id, wire.BurnInArgs(), self.timeout_s)
        except (TimeoutError, ConnectionError, RegistryError) as exc:
            self._tried[node_id] = time.monotonic()
            return False, f"burn-in of node {node_id} did not run: {exc}"
        result = ack.result or {}
        passed = ack.status == wire.AckStatus.DONE and result.get("passed") is True
        slow = self._screen(node_id, result.get("perf")) if passed else []
        if passed and not slow:
            slow = await self._probe_round(node_id)
        if passed and not slow:
            self._note_pass(node_id, seq)
            self._was_drained.discard(node_id)
            log.info(
                "node %s passed its burn-in",
                node_id,
                extra={"node": node_id, "event": "burn_in_passed"},
            )
            return True, ""
        reasons = slow or result.get("reasons") or [ack.detail or ack.status.value]
        why = f"failed burn-in: {'; '.join(str(r) for r in reasons)}"
        log.warning(
            "node %s %s; draining it",
            node_id,
            why,
            extra={"node": node_id, "event": "burn_in_failed"},
        )
        try:
            self.registry.drain(node_id, why, by="supervisor")
        except RegistryError as exc:
            log.warning("could not drain node %s after its failed burn-in: %s", node_id, exc)
        return False, why

    def _note_pass(self, node_id: str, seq: int | None) -> None:
        """``node_id`` passed a burn-in under birth ``seq`` (None: not known, no pass)."""
        if seq is not None:
            self._passed[node_id] = seq
            self._passed_at[node_id] = time.time()
            self._last_pass[node_id] = seq

    def _screen(self, node_id: str, raw: Any) -> list[str]:
        """Why the speed a passing burn-in of ``node_id`` measured keeps it out (empty:
        it joins). Its figures count for the nodes after it either way: a fleet-wide
        change (a driver, a power cap) moves the median with it, and the median shrugs
        off the odd slow node. Peers are the nodes of the same GPU model and count
        measured within ``PERF_KEPT_S`` that are still in the fleet."""
        perf = parse_perf(raw)
        node = self.registry.nodes.get(node_id)
        if perf is None or node is None or node.birth is None or not node.birth.gpus:
            return []
        kind = (node.birth.gpus[0].model, len(node.birth.gpus))
        now = time.time()
        for gone in [n for n in self._perf if n not in self.registry.nodes]:
            del self._perf[gone]
        peers = [
            p
            for n, (k, at, p) in self._perf.items()
            if n != node_id and k == kind and now - at <= PERF_KEPT_S
        ]
        self._perf[node_id] = (kind, now, perf)
        s = self.screening
        return screen(
            perf,
            peers,
            model=f"{kind[1]}-GPU {kind[0]}",
            max_slowdown=s.max_slowdown,
            min_link=s.min_link,
            min_peers=s.min_peers,
        )

    def fleet_links(self) -> list[float]:
        """The rates (MB/s) of the links probed within ``PERF_KEPT_S``."""
        now = time.time()
        return [mb_s for at, mb_s in self._links if now - at <= PERF_KEPT_S]

    async def probe_link(self, node_id: str, peer_id: str) -> Way:
        """Have ``node_id`` read from ``peer_id`` (``wire.ProbeLinkArgs``): (MB/s, why not,
        whether the link failed). The MB/s is None when nothing was measured: the link
        failed (no connection, nothing carried: the third value True), or the probe did
        not run (no answer, a peer that refused it or does not know it: False)."""
        ways = await self._probe(node_id, peer_id, both_ways=False)
        return ways[0]

    async def probe_link_both_ways(self, node_id: str, peer_id: str) -> tuple[Way, Way]:
        """Have ``node_id`` read from ``peer_id`` and then send to it, in one command
        (``wire.ProbeLinkArgs.both_ways``; both agents must announce
        ``wire.FEATURE_PROBE_BOTH_WAYS``): what :meth:`probe_link` says of each way,
        from ``peer_id`` to ``node_id`` first. When the first way gave no figure, the
        second says the same."""
        forward, *back = await self._probe(node_id, peer_id, both_ways=True)
        return forward, back[0] if back else forward

    def _knows_both_ways(self, node_id: str) -> bool:
        node = self.registry.nodes.get(node_id)
        return (
            node is not None
            and node.birth is not None
            and wire.FEATURE_PROBE_BOTH_WAYS in node.birth.features
        )

    async def _probe(self, node_id: str, peer_id: str, *, both_ways: bool) -> list[Way]:
        peer = self.registry.nodes.get(peer_id)
        if peer is None or peer.birth is None or not peer.birth.http_port:
            return [(None, f"node {peer_id} has not announced its address", False)]
        # One probe at a time on a node (it serves one stream, and two would each measure
        # half the link): a recovery's probe may wait for a survey's or a burn-in's.
        first, second = sorted((node_id, peer_id))
        address, port = peer.birth.address, peer.birth.http_port
        async with self._probe_lock(first), self._probe_lock(second):
            return await self._probe_link(node_id, peer_id, address, port, both_ways=both_ways)

    def _probe_lock(self, node_id: str) -> asyncio.Lock:
        lock = self._probe_locks.get(node_id)
        if lock is None:
            lock = self._probe_locks[node_id] = asyncio.Lock()
        return lock

    async def _probe_link(
        self, node_id: str, peer_id: str, address: str, http_port: int, *, both_ways: bool
    ) -> list[Way]:
        """The command: [the way from ``peer_id``] and, ``both_ways``, [the way back]
        when the first gave a figure."""
        credential = self._agent_keys.peer_credential(holder=peer_id, peer=node_id)
        args = wire.ProbeLinkArgs(
            peer=wire.PeerAddr(
                node=peer_id, address=address, http_port=http_port, token=credential
            ),
            nbytes=self.screening.probe_bytes,
            max_s=PROBE_MAX_S,
            both_ways=both_ways,
        )
        try:
            ack = await self._send(
                node_id, args, PROBE_BOTH_WAYS_COMMAND_S if both_ways else PROBE_COMMAND_S
            )
        except (TimeoutError, ConnectionError, RegistryError) as exc:
            why = f"the probe from node {peer_id} to node {node_id} did not run: {exc}"
            return [(None, why, False)]
        result = ack.result or {}
        if ack.status != wire.AckStatus.DONE:
            return [
                (None, f"node {node_id} did not probe: {ack.detail or ack.status.value}", False)
            ]
        forward = _way(node_id, result)
        if not both_ways or forward[0] is None:
            return [forward]
        if "back_error" in result:
            return [
                forward,
                (None, str(result["back_error"])[:500], result.get("back_reached") is False),
            ]
        back = result.get("back")
        if not isinstance(back, dict):
            return [
                forward,
                (None, f"node {node_id}'s probe gave no rate back: {result!r:.200}", False),
            ]
        return [forward, _way(node_id, back)]

    async def _both_ways(
        self, node_id: str, peer_id: str
    ) -> tuple[tuple[float, str] | None, str, bool]:
        """Probe the link between two nodes both ways (a degraded link may be slow one way
        only), recording each figure: ((the slower way's MB/s, that way in words), why
        not measured, whether the link failed). One command when both agents know
        ``both_ways`` (it is on a recovery's path: one round trip, not two); else two,
        one after the other."""
        ways = ((node_id, peer_id), (peer_id, node_id))  # (reader, sender)
        if self._knows_both_ways(node_id) and self._knows_both_ways(peer_id):
            found = list(await self.probe_link_both_ways(node_id, peer_id))
        else:
            found = []
        slowest: tuple[float, str] | None = None
        for i, (reader, sender) in enumerate(ways):
            way = f"the link from node {sender} to node {reader}"
            mb_s, why, failed = found[i] if found else await self.probe_link(reader, sender)
            if failed:
                return None, f"{way} failed: {why}", True
            if mb_s is None:
                return None, why, False
            self._links.append((time.time(), mb_s))
            if slowest is None or mb_s < slowest[0]:
                slowest = (mb_s, way)
        return slowest, "", False

    def _idle(self, *, but: Collection[str] = ()) -> list[str]:
        """The nodes up, in no job (a probe would measure a job's traffic with its own)
        and with an HTTP port, the least lately probed first."""
        busy = set(self._busy()) | set(but)
        idle = [
            n.id
            for n in self.registry.nodes.values()
            if n.id not in busy
            and n.state is NodeState.UP
            and n.birth is not None
            and n.birth.http_port
        ]
        for gone in [n for n in self._probed_from if n not in self.registry.nodes]:
            del self._probed_from[gone]
        for gone in [n for n, lock in self._probe_locks.items() if not lock.locked()]:
            if gone not in self.registry.nodes:
                del self._probe_locks[gone]
        return sorted(idle, key=lambda n: (self._probed_from.get(n, 0.0), n))

    async def screen_join(self, node_id: str, peer_id: str) -> tuple[bool, str]:
        """Whether ``node_id`` may join a job of ``peer_id``'s as a replacement: the link
        between them carries, both ways, at least ``min_p2p`` of the fleet's median (once
        the fleet has ``min_peers`` figures), and carries at all. (joins, why not); a
        probe that did not run, or probes turned off, do not keep it out."""
        s = self.screening
        if not s.probe_bytes:
            return True, ""
        fleet = self.fleet_links()
        slowest, why, failed = await self._both_ways(node_id, peer_id)
        if failed:
            return False, f"unreachable_p2p: {why}"
        if slowest is None:
            log.warning("the link between nodes %s and %s is not judged: %s", peer_id, node_id, why)
            return True, ""
        mb_s, way = slowest
        verdict = screen_p2p(mb_s, fleet, link=way, min_fraction=s.min_p2p, min_peers=s.min_peers)
        log.info(
            "%s carried %.3f MB/s (the slower way)%s",
            way,
            mb_s,
            f": {verdict}" if verdict else "",
            extra={"node": node_id, "event": "link_probed"},
        )
        return verdict is None, verdict or ""

    async def _probe_round(self, node_id: str) -> list[str]:
        """A burn-in's links: between ``node_id`` and up to ``PROBE_TARGETS`` idle nodes,
        both ways, one after the other. The reasons it fails (empty: it passes, or too
        few nodes were probed to tell a slow link of its own from one of theirs)."""
        s = self.screening
        if not s.probe_bytes:
            return []
        fleet = self.fleet_links()
        figures: list[tuple[str, float]] = []
        for peer_id in self._idle(but={node_id})[:PROBE_TARGETS]:
            self._probed_from[peer_id] = time.time()
            slowest, why, failed = await self._both_ways(node_id, peer_id)
            if failed:  # carried nothing: as slow as a link gets
                log.info("burn-in of node %s: %s", node_id, why)
                figures.append((peer_id, 0.0))
                continue
            if slowest is None:
                log.info("burn-in of node %s: no probe with node %s: %s", node_id, peer_id, why)
                continue
            figures.append((peer_id, slowest[0]))
        if len(figures) < PROBE_TARGETS:
            return []  # too few to tell a slow link of this node's from one of a peer's
        typical = median(mb for _, mb in figures)
        names = ", ".join(peer for peer, _ in figures)
        verdict = screen_p2p(
            typical,
            fleet,
            link=f"by their median, its links with nodes {names} (the slower way of each)",
            min_fraction=s.min_p2p,
            min_peers=s.min_peers,
        )
        return [verdict] if verdict else []

    def survey(self) -> None:
        """Keep the fleet's link figures fresh, for the replacements judged by them: now
        and then (every ``SURVEY_EARLY_S`` while there are fewer than ``min_peers``, then
        every ``SURVEY_S``) the two idle nodes least lately probed probe each other, in
        a task (one at a time). Called from the controller's loop."""
        s = self.screening
        if not s.probe_bytes or self._surveying is not None:
            return
        # Timed first: this runs at every scheduling pass, the figures' count seldom.
        since = time.monotonic() - self._surveyed_at
        if since < SURVEY_EARLY_S or (since < SURVEY_S and len(self.fleet_links()) >= s.min_peers):
            return
        pair = self._idle()[:2]
        if len(pair) < 2:
            return
        self._surveyed_at = time.monotonic()
        for node in pair:
            self._probed_from[node] = time.time()
        task = self._tasks.spawn(self._both_ways(*pair), name="link-survey")
        if task is not None:
            self._surveying = task
            task.add_done_callback(self._surveyed)

    def _surveyed(self, task: asyncio.Task[Any]) -> None:
        self._surveying = None
        self._surveyed_at = time.monotonic()
        if not task.cancelled() and task.exception() is None:
            _, why, _ = task.result()
            if why:
                log.info("link survey: %s", why)

    async def recheck(self, node_id: str) -> tuple[bool | None, str]:
        """Burn ``node_id`` in again now, though it may have passed before (a replica on it
        diverged and no majority names the odd one; its ranks are stopped): its burn-in's
        deterministic recompute check says whether its GPUs compute right. (passed, why
        not); passed is None when it could not run (no ack, an expired command, an agent
        error). The node is not drained here: the recovery quarantines the one that
        failed. A pass counts as the node's burn-in."""
        node = self.registry.nodes.get(node_id)
        seq = node.birth.seq if node is not None and node.birth is not None else None
        try:
            ack = await self._send(node_id, wire.BurnInArgs(), self.timeout_s)
        except (TimeoutError, ConnectionError, RegistryError) as exc:
            return None, f"its recheck did not run: {exc}"
        if ack.status != wire.AckStatus.DONE:
            return None, f"its recheck did not run: {ack.detail or ack.status.value}"
        result = ack.result or {}
        if result.get("passed") is True:
            self._note_pass(node_id, seq)
            return True, ""
        reasons = result.get("reasons") or ["no reason given"]
        return False, f"failed its recheck: {'; '.join(str(r) for r in reasons)}"

    def close(self) -> None:
        """Start no burn-in from now on (those running go on)."""
        self._tasks.close()

    async def shutdown(self, timeout: float) -> None:
        """Start no burn-in; wait up to ``timeout`` s for those running, cancel the rest."""
        await self._tasks.shutdown(timeout)


def _way(node_id: str, result: dict[str, Any]) -> Way:
    """One way's figure in a probe's result (the ack's, or its ``back``)."""
    if "error" in result:
        return None, str(result["error"])[:500], result.get("reached") is False
    mb_s = result.get("mb_s")
    if isinstance(mb_s, bool) or not isinstance(mb_s, int | float) or not mb_s >= 0:
        return None, f"node {node_id}'s probe gave no rate: {result!r:.200}", False
    return float(mb_s), "", False
