"""Model FLOPs utilisation: the FLOPs a job's ranks say each step costs, per second,
over the peak of the GPUs they run on.

A rank reports its model's FLOPs per step as the ``flops`` scalar of
``phalanx.rank.step`` (for a transformer, about 6 x parameters x its tokens per step).
The peak of a GPU comes from its model name (NVML's, as the node's birth reports it):
the settings' ``gpu_peak_flops`` first (exact name), else :data:`PEAKS`, dense BF16
tensor-core figures from NVIDIA's data sheets (no sparsity). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

FLOPS: Final = "flops"  # the rank's scalar: model FLOPs of one step on this rank

# (substring of the model name, peak FLOP/s), the first that matches wins: the more
# specific names first.
PEAKS: Final[tuple[tuple[str, float], ...]] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("B100", 1.75e15),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)


def peak_flops(model: str | None, overrides: Mapping[str, float] = {}) -> float | None:
    """The peak FLOP/s of one GPU of ``model`` (None: not known)."""
    if not model:
        return None
    if model in overrides:
        return overrides[model]
    for part, peak in PEAKS:
        if part.lower() in model.lower():
            return peak
    return None


def mfu(ranks: Iterable[tuple[float | None, float | None, float | None]]) -> float | None:
    """The gang's MFU from each rank's (FLOPs per step, seconds per step, its GPU's peak
    FLOP/s); None unless every rank has all three (a partial figure would mislead)."""
    achieved = peak = 0.0
    seen = False
    for flops, step_s, gpu_peak in ranks:
        if flops is None or step_s is None or gpu_peak is None or step_s <= 0 or gpu_peak <= 0:
            return None
        achieved += flops / step_s
        peak += gpu_peak
        seen = True
    return achieved / peak if seen else None
