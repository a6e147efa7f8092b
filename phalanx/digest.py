"""A cheap digest of a model's parameters, computed where they live (silent data corruption).

Data-parallel replicas hold bit-identical parameters after every optimizer step; a GPU
that computes wrong numbers without an error makes one replica differ. :func:`digest`
sums each tensor's bytes viewed as 64-bit integers (the last word padded with zeros)
on the tensor's own device, weights tensor ``i``'s sum by the odd number ``2i + 1`` and
adds them up, also on the device: one 8-byte copy to the host in all. Sums wrap around
modulo 2**64. Any single flipped bit changes the digest (it moves one word by
``2**k``, times an odd weight: never 0 modulo 2**64); so do most other changes. It is
no cryptographic hash: two changes can cancel, which a faulty GPU does not aim for.

Cost (``bench/digest.py``): memory-bound, one read of the parameters; see
docs/jobspec.md, "Silent data corruption", for the figures measured.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import torch

__all__ = ["MASK", "digest"]

MASK: Final = (1 << 64) - 1


def digest(model: Any) -> int:
    """The digest of ``model``'s parameters (a ``torch.nn.Module``) or of an iterable of
    tensors, as an unsigned 64-bit integer (see the module doc)."""
    import torch

    tensors: Iterable[torch.Tensor] = (
        model.parameters() if isinstance(model, torch.nn.Module) else model
    )
    total: torch.Tensor | None = None
    for i, tensor in enumerate(tensors):
        if tensor.numel() == 0:
            continue
        part = _sum(tensor.detach()) * (2 * i + 1)
        total = part if total is None else total + part.to(total.device)
    if total is None:
        return 0
    return int(total.item()) & MASK


def _sum(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as little-endian 64-bit words, summed (wrapping) on its device; the
    last, partial word padded with zeros. int64 words: torch sums them natively, ~27x
    faster than int32 elements widened to int64 (``bench/digest.py``)."""
    import torch

    raw = t.contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    out = raw[:whole].view(torch.int64).sum() if whole else raw.new_zeros((), dtype=torch.int64)
    if whole < raw.numel():
        tail = raw[whole:].to(torch.int64)
        shifts = torch.arange(tail.numel(), device=raw.device, dtype=torch.int64) * 8
        out = out + (tail << shifts).sum()
    return out
