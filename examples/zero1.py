"""tinylm with sharded optimizer state (ZeRO stage 1) that reshards itself: an elastic
job with ``elastic: {state: sharded, reshard: true}``.

Every rank holds the whole model, but AdamW's two moments only for its own contiguous
part of the flattened parameters (``part``): it averages the gradients with the other
ranks, updates its part, and gathers the parts of the others. A checkpoint shard is one
rank's part of the moments (and the parameters, which every rank holds). When the gang
changes size (a shrink after a lost node, a grow back), the parts move: rank ``r`` of
the new gang asks which step it restores and how many ranks saved it
(``Checkpointer.saved_layout()``), reads the saved shards its new part overlaps
(``Checkpointer.restore_shards(ranks, step)``) and cuts its part out of them. The global batch
stays the spec's (``phalanx.rank.ElasticSampler``), so the run trains the same samples
in the same steps at every size.

Run by hand (no Phalanx) it trains without checkpoints, one process accumulating the
whole global batch (``--global-batch``, ``--micro-batch``), for a reference loss.

``--log-full`` makes rank 0 log a digest of the whole, gathered optimizer state at each
save and after each restore, so that a test can check that resharding lost nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn

import phalanx.rank
from phalanx.elastic import Elastic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinylm import TinyLM, TokenStream

BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 0.01


def part(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s slice ``[lo, hi)`` of ``n`` values split among ``world`` ranks."""
    return rank * n // world, (rank + 1) * n // world


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def gather(mine: torch.Tensor, n: int, world: int) -> torch.Tensor:
    """The whole vector of ``n`` values from every rank's part (gloo's all-gather wants
    equal sizes: the parts are padded to the largest)."""
    size = -(-n // world)
    padded = torch.zeros(size, dtype=mine.dtype)
    padded[: mine.numel()] = mine
    out = [torch.empty(size, dtype=mine.dtype) for _ in range(world)]
    dist.all_gather(out, padded)
    return torch.cat([out[r][: part(n, world, r)[1] - part(n, world, r)[0]] for r in range(world)])


def digest(*tensors: torch.Tensor) -> str:
    h = xxhash.xxh3_128()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def reshard(
    shards: dict[int, dict[str, Any]], saved: int, n: int, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """This rank's part ``[lo, hi)`` of the moments, cut out of the saved ranks' parts
    (each saved its ``[klo, khi)``), and the parameters and Adam's step count."""
    m, v = torch.zeros(hi - lo), torch.zeros(hi - lo)
    filled = 0
    for k, shard in shards.items():
        klo, khi = part(n, saved, k)
        if (int(shard["lo"]), int(shard["hi"])) != (klo, khi):
            raise ValueError(f"saved rank {k}'s part is not [{klo}, {khi}) of {saved}")
        a, b = max(lo, klo), min(hi, khi)
        if a < b:
            m[a - lo : b - lo] = shard["exp_avg"][a - klo : b - klo]
            v[a - lo : b - lo] = shard["exp_avg_sq"][a - klo : b - klo]
            filled += b - a
    if filled != hi - lo:
        raise ValueError(f"the saved shards cover {filled} of this part's {hi - lo} values")
    first = shards[min(shards)]
    return first["params"], m, v, int(first["t"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--dataset-size", type=int, default=48)
    ap.add_argument("--global-batch", type=int, default=24, help="by hand only")
    ap.add_argument("--micro-batch", type=int, default=2, help="by hand only")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--log-full", action="store_true")
    args = ap.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    vocab, seq = 32, 8
    model = TinyLM(vocab, 16, 1, 2, seq)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    lo, hi = part(n, world, rank)
    exp_avg, exp_avg_sq, t = torch.zeros(hi - lo), torch.zeros(hi - lo), 0
    elastic = phalanx.rank.elastic() or Elastic.for_size(args.global_batch, args.micro_batch, world)
    sampler = phalanx.rank.ElasticSampler(args.dataset_size, elastic, dp_rank=rank, seed=args.seed)
    samples = TokenStream(vocab, seq, 1)
    loss_fn = nn.CrossEntropyLoss()

    ckpt = phalanx.rank.checkpointer() if os.environ.get("PHALANX_AGENT_SOCKET") else None
    start = 0
    if ckpt is not None and (layout := ckpt.saved_layout()) is not None:
        restore_step, saved = layout
        # The saved parts this rank's part overlaps (at least one: the parameters and
        # Adam's step count are in every shard, also for a rank whose part is empty).
        need = [
            k for k in range(saved) if max(lo, part(n, saved, k)[0]) < min(hi, part(n, saved, k)[1])
        ] or [min(rank, saved - 1)]
        found = ckpt.restore_shards(need, restore_step)
        assert found is not None
        start, shards = found
        whole, exp_avg, exp_avg_sq, t = reshard(shards, saved, n, lo, hi)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(whole, params)
        line: dict[str, Any] = {
            "restored": start,
            "rank": rank,
            "saved_world": saved,
            "world": world,
            "read": need,
            "from": ckpt.restored_from,
            "reshard": os.environ.get("PHALANX_RESHARD"),  # restore() refuses another size
        }
        print(json.dumps(line), flush=True)
        if args.log_full:
            full = (gather(exp_avg, n, world), gather(exp_avg_sq, n, world))
            if rank == 0:
                print(
                    json.dumps({"restored_full": start, "digest": digest(whole, *full)}), flush=True
                )

    if ckpt is not None:  # every rank restored the same step (one layout for the gang)
        steps = torch.tensor([start, -start])
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        if int(steps[0]) != start or -int(steps[1]) != start:
            raise RuntimeError(
                f"ranks restored different steps: {-int(steps[1])} to {int(steps[0])}"
            )

    last_loss = math.nan
    for step in range(start, args.steps):
        for p in params:
            p.grad = None
        micro = sampler.micro_batches(step)
        total = torch.zeros(())
        for chunk in micro:
            batch = torch.stack([samples.get(j)[0] for j in chunk])
            logits = model(batch[:, :-1])
            loss = loss_fn(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1)) / len(micro)
            loss.backward()
            total += loss.detach()
        grad = flat([p.grad for p in params])  # type: ignore[misc]
        dist.all_reduce(grad)
        grad /= world  # the global batch's mean gradient
        # AdamW on this rank's part only, then every part from its owner.
        t += 1
        g = grad[lo:hi]
        with torch.no_grad():
            whole = flat([p.detach() for p in params])
            mine = whole[lo:hi].clone()
            exp_avg.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
            exp_avg_sq.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            denom = (exp_avg_sq / (1 - BETAS[1] ** t)).sqrt_().add_(EPS)
            mine.mul_(1 - args.lr * WEIGHT_DECAY)
            mine.addcdiv_(exp_avg, denom, value=-args.lr / (1 - BETAS[0] ** t))
            torch.nn.utils.vector_to_parameters(gather(mine, n, world), params)
        mean = total.clone()
        dist.all_reduce(mean)
        last_loss = mean.item() / world
        phalanx.rank.step(step, loss=last_loss)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        done = step + 1
        if ckpt is not None and done % args.ckpt_every == 0:
            whole = flat([p.detach() for p in params])
            state = {
                "params": whole,
                "lo": lo,
                "hi": hi,
                "t": t,
                "exp_avg": exp_avg.clone(),
                "exp_avg_sq": exp_avg_sq.clone(),
            }
            if args.log_full:
                full = (gather(exp_avg, n, world), gather(exp_avg_sq, n, world))
                if rank == 0:
                    print(
                        json.dumps({"saved_full": done, "digest": digest(whole, *full)}), flush=True
                    )
            ckpt.save(done, state)
    phalanx.rank.finished(args.steps)
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    if rank == 0:
        print(
            json.dumps({"done": True, "steps": args.steps, "last_loss": round(last_loss, 4)}),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as tinylm: gloo's threads must not outlive a finalising interpreter


if __name__ == "__main__":
    main()
