"""Judging samples: GPU and host readings in, ``ok`` / ``warn`` / ``drain`` and reasons out.

The classifier is plain code over plain samples (no I/O, the clock passed in),
so every rule is unit-tested against the simulated backend's samples and the
NVML backend's alike. Some rules need memory: XID events are one-shot, the
corrected-ECC rate needs a window, a slowdown must be sustained, and a GPU
that vanished is measured against the count the node had at birth.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from agentd.config import Thresholds
from agentd.gpu.base import GpuSample, NodeSample, RecoveryAction, Throttle
from phalanx.wire import GpuGauges, Health, HealthStatus, HostGauges, Reason

SLOWDOWN = frozenset(
    {Throttle.HW_SLOWDOWN, Throttle.HW_THERMAL, Throttle.SW_THERMAL, Throttle.HW_POWER_BRAKE}
)


def _drain(code: str, detail: str, gpu: int | None = None) -> Reason:
    return Reason(code=code, severity="drain", gpu=gpu, detail=detail)


def _warn(code: str, detail: str, gpu: int | None = None) -> Reason:
    return Reason(code=code, severity="warn", gpu=gpu, detail=detail)


@dataclass
class _GpuMemory:
    sbe: deque[tuple[float, int]] = field(default_factory=deque)
    slowdown_since: float | None = None


class HealthClassifier:
    """Stateful judge of one node's samples; feed it every sample in time order."""

    def __init__(self, thresholds: Thresholds, gpus_at_birth: int) -> None:
        self.t = thresholds
        self.gpus_at_birth = gpus_at_birth
        self._gpu: dict[int, _GpuMemory] = {}
        self._xids: dict[tuple[int, int], float] = {}  # (gpu, xid) -> last seen

    def classify(
        self,
        sample: NodeSample | None,
        host: HostGauges | None,
        now: float,
        *,
        backend_error: str | None = None,
    ) -> Health:
        """``sample`` None with ``backend_error`` set: the backend failed or hung."""
        reasons: list[Reason] = []
        if backend_error is not None:
            code = "nvml_hang" if "timed out" in backend_error else "nvml_error"
            reasons.append(_drain(code, backend_error))
        if sample is not None:
            reasons.extend(self._node_rules(sample, now))
            for gpu in sample.gpus:
                reasons.extend(self._gpu_rules(gpu, now))
        if host is not None:
            reasons.extend(self._host_rules(host))
        status = HealthStatus.OK
        if any(r.severity == "drain" for r in reasons):
            status = HealthStatus.DRAIN
        elif reasons:
            status = HealthStatus.WARN
        gauges = [_gauges(g) for g in sample.gpus] if sample is not None else []
        return Health(status=status, reasons=reasons, gpus=gauges, host=host, sampled_at=now)

    def _node_rules(self, sample: NodeSample, now: float) -> list[Reason]:
        reasons = [_drain("nvml_error", err) for err in sample.errors]
        if len(sample.gpus) < self.gpus_at_birth and not sample.errors:
            reasons.append(
                _drain(
                    "gpu_missing",
                    f"{len(sample.gpus)} GPUs visible, {self.gpus_at_birth} at birth",
                )
            )
        for gpu, xid in sample.xids:
            self._xids[(gpu, xid)] = now
        for (gpu, xid), seen in sorted(self._xids.items()):
            if now - seen > self.t.xid_hold_s:
                del self._xids[(gpu, xid)]
            elif xid in self.t.drain_xids:
                reasons.append(_drain(f"xid_{xid}", f"XID {xid} at {_utc(seen)}", gpu))
            elif xid in self.t.warn_xids:
                reasons.append(_warn(f"xid_{xid}", f"XID {xid} at {_utc(seen)}", gpu))
        return reasons

    def _gpu_rules(self, g: GpuSample, now: float) -> list[Reason]:
        t, i = self.t, g.index
        r: list[Reason] = [_drain("nvml_error", err, i) for err in g.errors]
        if g.ecc_dbe_volatile:
            r.append(_drain("ecc_dbe", f"{g.ecc_dbe_volatile} uncorrected ECC errors", i))
        if g.remap_failed:
            r.append(_drain("row_remap_failed", "a row remap failed: RMA candidate", i))
        elif g.remap_pending:
            r.append(_warn("row_remap_pending", "row remap pending: reset the GPU when idle", i))
        if g.retired_pages is not None and g.retired_pages > t.retired_pages_drain:
            r.append(
                _drain(
                    "retired_pages", f"{g.retired_pages} retired pages > {t.retired_pages_drain}", i
                )
            )
        if g.retired_pending:
            r.append(_drain("retirement_pending", "page retirement pending", i))
        if g.recovery_action not in (None, RecoveryAction.NONE):
            r.append(_drain("recovery_action", f"NVML asks for {g.recovery_action}", i))
        if g.nvlink_down:
            r.append(_drain("nvlink_down", f"NVLink links down: {list(g.nvlink_down)}", i))
        if g.temperature_c is not None:
            if g.temp_shutdown_c is not None and g.temperature_c >= g.temp_shutdown_c:
                r.append(
                    _drain(
                        "temp_shutdown",
                        f"{g.temperature_c:.0f}C >= shutdown {g.temp_shutdown_c:.0f}C",
                        i,
                    )
                )
            elif g.temp_slowdown_c is not None and g.temperature_c >= g.temp_slowdown_c:
                r.append(
                    _warn(
                        "temp_slowdown",
                        f"{g.temperature_c:.0f}C >= slowdown {g.temp_slowdown_c:.0f}C",
                        i,
                    )
                )
        mem = self._gpu.setdefault(i, _GpuMemory())
        r.extend(self._sbe_rate(mem, g, now))
        r.extend(self._slowdown(mem, g, now))
        return r

    def _sbe_rate(self, mem: _GpuMemory, g: GpuSample, now: float) -> list[Reason]:
        if g.ecc_sbe_volatile is None:
            return []
        window = mem.sbe
        if window and g.ecc_sbe_volatile < window[-1][1]:
            window.clear()  # counters reset (driver reload): start a new window
        window.append((now, g.ecc_sbe_volatile))
        while len(window) > 2 and now - window[1][0] >= self.t.sbe_window_s:
            window.popleft()
        (t0, c0), (t1, c1) = window[0], window[-1]
        if t1 <= t0 or c1 <= c0:
            return []
        rate = (c1 - c0) / (t1 - t0) * 3600.0
        if rate <= self.t.sbe_rate_warn_per_hour:
            return []
        return [
            _warn(
                "ecc_sbe_rate",
                f"{rate:.0f} corrected ECC errors/hour > {self.t.sbe_rate_warn_per_hour:.0f}",
                g.index,
            )
        ]

    def _slowdown(self, mem: _GpuMemory, g: GpuSample, now: float) -> list[Reason]:
        active = sorted(g.throttle & SLOWDOWN)
        if not active:
            mem.slowdown_since = None
            return []
        if mem.slowdown_since is None:
            mem.slowdown_since = now
        lasted = now - mem.slowdown_since
        if lasted < self.t.slowdown_sustain_s:
            return []
        return [
            _warn("slowdown", f"{', '.join(active)} for {lasted:.0f}s: straggler suspect", g.index)
        ]

    def _host_rules(self, h: HostGauges) -> list[Reason]:
        t, r = self.t, []
        if h.disk_free_bytes < t.disk_drain_bytes:
            r.append(_drain("disk_full", f"{h.disk_free_bytes} bytes free on the data disk"))
        elif h.disk_total_bytes and h.disk_free_bytes / h.disk_total_bytes < t.disk_warn_fraction:
            r.append(_warn("disk_low", f"{h.disk_free_bytes / h.disk_total_bytes:.1%} free"))
        if h.mem_total_bytes and h.mem_available_bytes / h.mem_total_bytes < t.mem_warn_fraction:
            r.append(
                _warn(
                    "mem_low", f"{h.mem_available_bytes / h.mem_total_bytes:.1%} memory available"
                )
            )
        if h.load1 > t.load_warn_per_cpu * h.cpu_count:
            r.append(_warn("load_high", f"load {h.load1:.1f} on {h.cpu_count} CPUs"))
        return r


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _finite(value: float | None) -> float | None:
    """A reading, or None (unknown) for one that is NaN or infinite: the wire carries
    finite numbers only (a sim file may say NaN; json reads it)."""
    return value if value is None or math.isfinite(value) else None


def _gauges(g: GpuSample) -> GpuGauges:
    return GpuGauges(
        index=g.index,
        temperature_c=_finite(g.temperature_c),
        power_w=_finite(g.power_w),
        util_pct=_finite(g.util_pct),
        mem_used_bytes=g.mem_used_bytes,
        mem_total_bytes=g.mem_total_bytes,
        ecc_sbe_volatile=g.ecc_sbe_volatile,
        ecc_dbe_volatile=g.ecc_dbe_volatile,
        retired_pages=g.retired_pages,
        throttle=sorted(g.throttle),
    )
