"""When to checkpoint: every N steps, every T seconds, or ``auto`` (Young/Daly).

``auto`` checkpoints every sqrt(2 x C x MTBF) seconds, C being the measured
cost of one checkpoint to the training loop (the ``save`` stall, and for a
lazy save the time the optimizer step waited for its copy: the write-down is
off the critical path) and MTBF the mean time between failures
of the whole job. Until a save has been measured, ``auto`` says "now" so that
it learns C from the first one.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

__all__ = ["Interval", "parse_interval"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_interval(interval: int | float | str) -> tuple[str, float]:
    """``("steps", n)``, ``("seconds", t)`` or ``("auto", 0)``: an int is a
    number of steps, a float or ``"90s"``/``"10m"``/``"1h"`` a number of
    seconds, ``"auto"`` the Young/Daly interval."""
    if isinstance(interval, bool):
        raise ValueError("interval must be a number of steps, seconds, or 'auto'; got a bool")
    if isinstance(interval, int):
        if interval < 1:
            raise ValueError(f"interval {interval} steps must be at least 1")
        return "steps", float(interval)
    if isinstance(interval, float):
        if not interval > 0 or not math.isfinite(interval):
            raise ValueError(f"interval {interval} seconds must be positive")
        return "seconds", interval
    if interval == "auto":
        return "auto", 0.0
    match = _DURATION.match(interval)
    if match is None:
        raise ValueError(
            f"interval {interval!r} must be an int (steps), a float or '90s'/'10m'/'1h' "
            "(seconds), or 'auto'"
        )
    return "seconds", float(match[1]) * _UNIT[match[2]]


@dataclass
class Interval:
    """The checkpoint policy of one ``Checkpointer``; see the module docstring."""

    kind: str
    every: float
    mtbf_s: float | None = None
    stall_s: float | None = None  # the measured cost C, a moving average
    last_step: int | None = None
    last_time: float = field(default_factory=time.monotonic)
    last_weight: float = 1.0  # the last save's share of ``stall_s``

    @classmethod
    def of(cls, interval: int | float | str, mtbf_s: float | None) -> Interval:
        kind, every = parse_interval(interval)
        if kind == "auto" and (mtbf_s is None or not mtbf_s > 0):
            raise ValueError("interval='auto' needs mtbf_s, the job's mean time between failures")
        return cls(kind, every, mtbf_s)

    def seconds(self) -> float | None:
        """The auto interval in seconds (``None`` before a stall is measured)."""
        if self.kind == "seconds":
            return self.every
        if self.kind == "auto" and self.stall_s is not None and self.mtbf_s is not None:
            return math.sqrt(2.0 * self.stall_s * self.mtbf_s)
        return None

    def due(self, step: int) -> bool:
        if step == self.last_step:
            return False
        if self.kind == "steps":
            return step % int(self.every) == 0
        if self.last_step is None:
            return True
        seconds = self.seconds()
        return seconds is None or time.monotonic() - self.last_time >= seconds

    def saved(self, step: int, stall_s: float) -> None:
        self.last_step = step
        self.last_time = time.monotonic()
        self.last_weight = 1.0 if self.stall_s is None else 0.3
        self.stall_s = stall_s if self.stall_s is None else 0.7 * self.stall_s + 0.3 * stall_s

    def waited(self, seconds: float) -> None:
        """The last (lazy) save held the loop ``seconds`` more: an optimizer step waited
        for its copy. Part of that save's cost."""
        if self.stall_s is not None:
            self.stall_s += self.last_weight * seconds
