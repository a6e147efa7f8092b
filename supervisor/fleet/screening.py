"""Pre-flight screening: a node joins only if it is about as fast as the fleet. Pure.

A burn-in reports the node's speed (``agentd.burnin``): its slowest GPU's synthetic
step and the bandwidth of an all-reduce between its GPUs. A slow GPU or a degraded
link taxes every step of a synchronous gang, since the gang waits for its slowest
member, yet such a node passes every health check. :func:`screen` compares the node's
figures with the median of the nodes of the same GPU model that passed before it
(``peers``): a step slower than the median by more than ``max_slowdown``, or an
all-reduce under ``min_link`` of the median, is a reason not to join. With fewer than
``min_peers`` peers there is nothing to compare with, and the node is not judged.

:func:`screen_p2p` judges a point-to-point link the same way: the rate a node read from
another node (``agentd.linkprobe``) against the median of the links probed lately.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any


@dataclass(frozen=True, slots=True)
class Perf:
    """A node's speed from its burn-in (None: not measured)."""

    step_s: float | None
    allreduce_gbps: float | None
    gpu_step_s: dict[str, float] = field(default_factory=dict)


def _positive(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) and value > 0 else None


def parse_perf(raw: Any) -> Perf | None:
    """The ``perf`` of a burn-in's result; None for none, or for one that is not a
    mapping (an agent older than screening, or garbage). Bad figures are left out."""
    if not isinstance(raw, dict):
        return None
    gpus = raw.get("gpu_step_s")
    per_gpu = {}
    if isinstance(gpus, dict):
        per_gpu = {str(k)[:16]: v for k, x in list(gpus.items())[:64] if (v := _positive(x))}
    perf = Perf(_positive(raw.get("step_s")), _positive(raw.get("allreduce_gbps")), per_gpu)
    return perf if perf.step_s is not None or perf.allreduce_gbps is not None else None


def screen(
    perf: Perf,
    peers: Sequence[Perf],
    *,
    model: str,
    max_slowdown: float,
    min_link: float,
    min_peers: int,
) -> list[str]:
    """The reasons ``perf`` keeps its node out, judged against ``peers`` (nodes of the
    same GPU ``model`` that passed); empty: it joins."""
    reasons = []
    steps = [p.step_s for p in peers if p.step_s is not None]
    if perf.step_s is not None and len(steps) >= max(1, min_peers):
        typical = median(steps)
        if perf.step_s > typical * (1 + max_slowdown):
            slowest = max(perf.gpu_step_s, key=lambda g: perf.gpu_step_s[g], default=None)
            which = f"GPU {slowest}'s" if slowest is not None else "its"
            reasons.append(
                f"slow_gpu: {which} synthetic step took {perf.step_s * 1000:.1f} ms, "
                f"{(perf.step_s / typical - 1) * 100:.0f}% slower than the median of "
                f"{len(steps)} {model} nodes ({typical * 1000:.1f} ms; the limit is "
                f"{max_slowdown * 100:.0f}%)"
            )
    links = [p.allreduce_gbps for p in peers if p.allreduce_gbps is not None]
    if perf.allreduce_gbps is not None and len(links) >= max(1, min_peers):
        typical = median(links)
        if perf.allreduce_gbps < typical * min_link:
            reasons.append(
                f"slow_link: the all-reduce between its GPUs ran at "
                f"{perf.allreduce_gbps:.1f} GB/s, under {min_link * 100:.0f}% of the median "
                f"of {len(links)} {model} nodes ({typical:.1f} GB/s)"
            )
    return reasons


def screen_p2p(
    mb_s: float, fleet: Sequence[float], *, link: str, min_fraction: float, min_peers: int
) -> str | None:
    """Why a ``link`` whose probe carried ``mb_s`` MB/s keeps its node out, judged against
    the fleet's recent probes (``fleet``, MB/s each); None: it joins, or there are fewer
    than ``min_peers`` probes to judge by."""
    if len(fleet) < max(1, min_peers):
        return None
    typical = median(fleet)
    if mb_s >= typical * min_fraction:
        return None
    return (
        f"slow_p2p: {link} carried {_mb(mb_s)} MB/s, {mb_s / typical * 100:.0f}% of the "
        f"median of the {len(fleet)} links probed lately ({_mb(typical)} MB/s; the limit is "
        f"{min_fraction * 100:.0f}%)"
    )


def _mb(mb_s: float) -> str:
    return f"{mb_s:.1f}" if mb_s >= 1 else f"{mb_s:.3f}"
