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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from phalanx import wire
from phalanx.tasks import Tasks
from supervisor.errors import RegistryError
from supervisor.fleet.registry import NodeState, Registry
from supervisor.fleet.screening import Perf, parse_perf, screen

log = logging.getLogger(__name__)

Sender = Callable[[str, wire.CommandArgsType, float], Awaitable[wire.CommandAck]]
RETRY_S = 30.0  # a burn-in that could not run (no ack) is tried again after this
PERF_KEPT_S = 24 * 3600.0  # a node's speed counts in the fleet's median this long


@dataclass(frozen=True, slots=True)
class Screening:
    """How much slower than the fleet a node may be (``SupervisorSettings.screen_*``)."""

    max_slowdown: float = 0.05
    min_link: float = 0.5
    min_peers: int = 3


class BurnIns:
    def __init__(
        self,
        registry: Registry,
        send: Sender,
        *,
        timeout_s: float = 60.0,
        screening: Screening | None = None,
    ) -> None:
        self.registry = registry
        self._send = send
        self.timeout_s = timeout_s
        self.screening = screening or Screening()
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
