"""Free GPUs per node during a pass, indexed so that placement does not scan the cluster.

Two views of the same nodes:

* view ``SHORT`` counts every free GPU. A job may use it when it ends before
  every reservation made so far, so whatever it takes comes back in time.
* view ``LONG`` hides the GPUs a reservation needs: on a reserved node a job
  that runs past the reserved start may use only the *surplus*, the GPUs the
  node will have at that start beyond what the reservation takes.

For each view the index keeps, per GPU type, how many nodes have at least
``g`` available GPUs (cluster-wide, per rack and per NVLink domain, for every
``g``), and one min-heap of node indices per exact availability, so a
single-node job finds its best-fitting node in a few heap peeks. Heaps are
lazy: an entry is stale when the node's availability has moved on.
"""

from __future__ import annotations

import heapq
import math

from supervisor.scheduler._layout import Layout
from supervisor.scheduler._model import Placement
from supervisor.scheduler._placement import select_nodes

SHORT = 0
LONG = 1
_UNRESERVED = 1 << 40


class Capacity:
    def __init__(self, layout: Layout, free: list[int], usable: list[bool]) -> None:
        self.layout = layout
        self.usable = usable
        n_nodes = len(layout.node_ids)
        width = layout.max_gpus + 1
        self.width = width
        self.free = [free[i] if usable[i] else 0 for i in range(n_nodes)]
        self.surplus = [_UNRESERVED] * n_nodes
        self.reserved_at = [math.inf] * n_nodes
        self.reserved_for: list[str | None] = [None] * n_nodes
        n_types = len(layout.types)
        n_racks = len(layout.racks)
        self.avail: tuple[list[int], list[int]] = (list(self.free), list(self.free))
        # Count nodes by exact availability, then turn the counts into "at least g".
        rack_ge = [[[0] * width for _ in range(n_racks)] for _ in range(n_types)]
        dom_ge = [[0] * width for _ in layout.dom_nodes]
        total_ge = [[0] * width for _ in range(n_types)]
        heaps: list[list[list[int]]] = [[[] for _ in range(width)] for _ in range(n_types)]
        node_type, node_rack, node_dom = layout.node_type, layout.node_rack, layout.node_dom
        for i, a in enumerate(self.free):
            if a > 0:
                t = node_type[i]
                rack_ge[t][node_rack[i]][a] += 1
                dom_ge[node_dom[i]][a] += 1
                total_ge[t][a] += 1
                heaps[t][a].append(i)  # ascending indices: already a heap
        for counts in (*(row for per_type in rack_ge for row in per_type), *dom_ge, *total_ge):
            for k in range(width - 2, 0, -1):
                counts[k] += counts[k + 1]
        self.rack_ge = (rack_ge, [[row[:] for row in per_type] for per_type in rack_ge])
        self.dom_ge = (dom_ge, [row[:] for row in dom_ge])
        self.total_ge = (total_ge, [row[:] for row in total_ge])
        self.heaps = (heaps, [[heap[:] for heap in per_type] for per_type in heaps])

    # -- bookkeeping -------------------------------------------------------

    def _move(self, v: int, i: int, new: int) -> None:
        avail = self.avail[v]
        old = avail[i]
        if old == new:
            return
        avail[i] = new
        layout = self.layout
        t = layout.node_type[i]
        rg = self.rack_ge[v][t][layout.node_rack[i]]
        dg = self.dom_ge[v][layout.node_dom[i]]
        tg = self.total_ge[v][t]
        if new > old:
            for k in range(old + 1, new + 1):
                rg[k] += 1
                dg[k] += 1
                tg[k] += 1
        else:
            for k in range(new + 1, old + 1):
                rg[k] -= 1
                dg[k] -= 1
                tg[k] -= 1
        if new > 0:
            heapq.heappush(self.heaps[v][t][new], i)

    def _refresh(self, i: int) -> None:
        free = self.free[i]
        self._move(SHORT, i, free)
        self._move(LONG, i, min(free, self.surplus[i]))

    def occupy(self, i: int, gpus: int, end: float) -> None:
        """A job that runs until ``end`` takes ``gpus`` GPUs of node ``i``."""
        if not self.usable[i]:
            return
        self.free[i] -= gpus
        if end > self.reserved_at[i]:
            self.surplus[i] -= gpus
        self._refresh(i)

    def release(self, i: int, gpus: int, end: float) -> None:
        """Undo `occupy` (a preempted job, which was due to run until ``end``)."""
        if not self.usable[i]:
            return
        self.free[i] += gpus
        if end > self.reserved_at[i]:
            self.surplus[i] += gpus
        self._refresh(i)

    def reserve(self, i: int, at: float, surplus: int, job_id: str) -> None:
        """Hold node ``i`` for ``job_id`` from ``at``; ``surplus`` GPUs stay usable past it."""
        self.reserved_at[i] = at
        self.surplus[i] = surplus
        self.reserved_for[i] = job_id
        self._refresh(i)

    # -- queries -----------------------------------------------------------

    def count(self, v: int, t: int, g: int) -> int:
        """Nodes of type ``t`` with at least ``g`` available GPUs in view ``v``."""
        return self.total_ge[v][t][g] if g < self.width else 0

    def place(
        self,
        v: int,
        t: int,
        n: int,
        g: int,
        placement: Placement,
        required: bool,
        max_racks: int | None,
    ) -> list[int] | None:
        """The nodes a job would start on in view ``v``, or None; changes nothing."""
        if g >= self.width or self.total_ge[v][t][g] < n:
            return None
        if n == 1:
            return [self._best_single(v, t, g)]
        rg = self.rack_ge[v][t]
        counts = [rg[r][g] for r in self.layout.type_racks[t]]
        dg = self.dom_ge[v]
        return select_nodes(
            self.layout,
            t,
            n,
            g,
            placement,
            required,
            max_racks,
            counts,
            lambda d: dg[d][g],
            self.avail[v],
        )

    def _best_single(self, v: int, t: int, g: int) -> int:
        avail = self.avail[v]
        heaps = self.heaps[v][t]
        for b in range(g, self.width):
            heap = heaps[b]
            while heap and avail[heap[0]] != b:
                heapq.heappop(heap)
            if heap:
                return heap[0]
        raise AssertionError("the eligible count said a node exists")  # pragma: no cover
