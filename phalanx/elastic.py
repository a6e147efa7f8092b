"""The rank side of an elastic job (the job spec's ``elastic:``): its size now, and a
sampler that never repeats or skips a sample when the gang shrinks or grows.

An elastic job keeps its global batch (samples per optimizer step) at every size: on
fewer nodes each rank accumulates more micro batches. The supervisor tells each
generation's ranks (environment variables, read by :func:`elastic`):

========================== =====================================================
``PHALANX_GLOBAL_BATCH``   samples per optimizer step (the spec's, at every size)
``PHALANX_MICRO_BATCH``    samples per forward and backward pass of one rank
``PHALANX_DP_SIZE``        data-parallel ranks of this generation (its world size)
``PHALANX_ACCUM_STEPS``    micro batches each rank accumulates per optimizer step
``PHALANX_CONSUMED_SAMPLES`` samples consumed before the step the gang restores
========================== =====================================================

Samples consumed is ``step x global_batch``: with the global batch constant it is the
step count, so a rank that restored step ``s`` has consumed ``elastic().consumed(s)``.

:class:`ElasticSampler` draws optimizer step ``t``'s global batch as positions
``t x global_batch`` to ``(t + 1) x global_batch`` of an endless stream of epochs,
each a seeded permutation of the dataset (as Megatron's pretraining sampler keys on
consumed samples). Which samples step ``t`` trains on does not depend on the size of
the gang, only how they are split: data-parallel rank ``d`` takes the ``d``-th share
of ``accumulation x micro_batch`` samples. Restarting at any step, on any size,
neither repeats nor skips a sample::

    import phalanx.rank

    e = phalanx.rank.elastic()                   # None: not an elastic job
    start = restored_step or 0
    sampler = phalanx.rank.ElasticSampler(len(dataset), e, dp_rank=rank, start_step=start)
    for step, micro_batches in zip(range(start, steps), sampler):
        for i, ids in enumerate(micro_batches):  # e.accumulation lists of micro_batch ids
            batch = collate([dataset[j] for j in ids])
            with ddp.no_sync() if i < len(micro_batches) - 1 else nullcontext():
                (loss_fn(ddp(batch)) / len(micro_batches)).backward()
        opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

ENV_GLOBAL_BATCH = "PHALANX_GLOBAL_BATCH"
ENV_MICRO_BATCH = "PHALANX_MICRO_BATCH"
ENV_DP_SIZE = "PHALANX_DP_SIZE"
ENV_ACCUM_STEPS = "PHALANX_ACCUM_STEPS"
ENV_CONSUMED = "PHALANX_CONSUMED_SAMPLES"
# Set to 1 for a job whose ranks reshard their sharded state (elastic.reshard).
ENV_RESHARD = "PHALANX_RESHARD"


@dataclass(frozen=True, slots=True)
class Elastic:
    """An elastic job's batch layout in this generation."""

    global_batch: int
    micro_batch: int
    dp_size: int
    accumulation: int
    consumed_samples: int = 0  # before the step the gang restores (0: a fresh start)

    def __post_init__(self) -> None:
        if min(self.global_batch, self.micro_batch, self.dp_size, self.accumulation) < 1:
            raise ValueError(f"an elastic layout needs positive sizes, not {self}")
        if self.global_batch != self.micro_batch * self.dp_size * self.accumulation:
            raise ValueError(
                f"global batch {self.global_batch} is not micro batch {self.micro_batch} x "
                f"data-parallel size {self.dp_size} x accumulation {self.accumulation}"
            )

    @classmethod
    def for_size(
        cls, global_batch: int, micro_batch: int, dp_size: int, consumed_samples: int = 0
    ) -> Elastic:
        if global_batch % (micro_batch * dp_size):
            raise ValueError(
                f"global batch {global_batch} is not a multiple of micro batch "
                f"{micro_batch} x data-parallel size {dp_size}"
            )
        accumulation = global_batch // (micro_batch * dp_size)
        return cls(global_batch, micro_batch, dp_size, accumulation, consumed_samples)

    def consumed(self, step: int) -> int:
        """Samples consumed once ``step`` optimizer steps are done."""
        return step * self.global_batch

    def env(self) -> dict[str, str]:
        return {
            ENV_GLOBAL_BATCH: str(self.global_batch),
            ENV_MICRO_BATCH: str(self.micro_batch),
            ENV_DP_SIZE: str(self.dp_size),
            ENV_ACCUM_STEPS: str(self.accumulation),
            ENV_CONSUMED: str(self.consumed_samples),
        }


def from_environment(environ: Mapping[str, str] | None = None) -> Elastic | None:
    """The layout the supervisor gave this generation; None when the job is not elastic.
    A partial or malformed set of variables is an error naming them, never a guess."""
    env = os.environ if environ is None else environ
    names = (ENV_GLOBAL_BATCH, ENV_MICRO_BATCH, ENV_DP_SIZE, ENV_ACCUM_STEPS)
    present = [n for n in names if n in env]
    if not present:
        return None
    if len(present) != len(names):
        missing = ", ".join(n for n in names if n not in env)
        raise ValueError(f"an elastic job's environment lacks {missing}")
    try:
        values = [int(env[n]) for n in names]
        consumed = int(env.get(ENV_CONSUMED, "0"))
    except ValueError as exc:
        raise ValueError(f"an elastic job's environment is malformed: {exc}") from None
    global_batch, micro_batch, dp_size, accumulation = values
    return Elastic(global_batch, micro_batch, dp_size, accumulation, consumed)


class ElasticSampler:
    """Per optimizer step from ``start_step`` on, this data-parallel rank's micro batches:
    ``layout.accumulation`` lists of ``layout.micro_batch`` sample indices into a dataset
    of ``size`` samples (see the module docstring). Endless: stop at the last step.

    ``shuffle``: each epoch a permutation seeded by ``seed`` and the epoch number (the
    same on every rank and every size); else the samples in order."""

    def __init__(
        self,
        size: int,
        layout: Elastic,
        *,
        dp_rank: int,
        start_step: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if size < 1:
            raise ValueError(f"a dataset of {size} samples cannot be sampled")
        if not 0 <= dp_rank < layout.dp_size:
            raise ValueError(f"data-parallel rank {dp_rank} is outside 0..{layout.dp_size - 1}")
        if start_step < 0:
            raise ValueError(f"start step {start_step} is negative")
        self.size, self.layout, self.dp_rank = size, layout, dp_rank
        self.step, self.seed, self.shuffle = start_step, seed, shuffle
        self._epoch: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._epoch is None or self._epoch[0] != epoch:
            order = list(range(self.size))
            if self.shuffle:
                random.Random(f"phalanx-elastic:{self.seed}:{epoch}").shuffle(order)
            self._epoch = (epoch, order)
        return self._epoch[1]

    def global_batch(self, step: int) -> list[int]:
        """Every sample of optimizer step ``step``, in the order the ranks split it."""
        g = self.layout.global_batch
        out = []
        for position in range(step * g, (step + 1) * g):
            epoch, i = divmod(position, self.size)
            out.append(self._order(epoch)[i])
        return out

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's micro batches of optimizer step ``step``."""
        lay = self.layout
        share = lay.accumulation * lay.micro_batch
        mine = self.global_batch(step)[self.dp_rank * share : (self.dp_rank + 1) * share]
        return [mine[i : i + lay.micro_batch] for i in range(0, share, lay.micro_batch)]

    def __iter__(self) -> Iterator[list[list[int]]]:
        while True:
            yield self.micro_batches(self.step)
            self.step += 1
