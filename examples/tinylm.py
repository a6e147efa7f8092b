"""A small transformer language model trained with DDP on a deterministic token stream.

Run under Phalanx (the agent sets RANK, WORLD_SIZE, MASTER_ADDR, ...), or by hand::

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python examples/tinylm.py

gloo on CPU, NCCL where CUDA is available. The token stream is a fixed
random Markov chain (seeded), so the loss has something to learn and every
run sees the same data: rank r of a world of w reads batch ``step * w + r``.
Rank 0 logs loss and tokens/s; the last line says whether the loss went down.

Under Phalanx it checkpoints with ``ckpt.Checkpointer()`` every ``--ckpt-every``
steps (model, optimizer, LR scheduler, the RNGs of torch, numpy and python,
and the data position, which is the step) and, at start, restores the latest
committed checkpoint if the job has one, from the nearest tier that holds a
good copy. ``--ckpt-digests`` makes every rank log a digest of each state it
saves and of the state it resumes with (what the tests compare bit for bit).
Run by hand (no agent), it checkpoints only with ``--ckpt-dir PATH`` (the tiers
in-process, under PATH).

Saves are lazy by default (``phalanx.rank.checkpointer(opt)`` attaches the
optimizer): a save returns once the copy of the parameters and Adam's moments
into RAM is started, and the next ``opt.step()`` waits for it, so the copy hides
behind the next forward and backward. Nothing else here changes those tensors in
place between steps (no EMA), so nothing else needs ``fence()``.
``--blocking-saves`` copies the whole state before ``save`` returns instead; both
train to the same final digest.

Every step is reported to the agent with ``phalanx.rank.step`` (the gang's mean
loss, the gradient norm, this rank's tokens, the lr and the seconds the step waited
for its batch), which is how the agent sees hung ranks and the supervisor draws the
run (``phalanx metrics JOB``); when the agent asks for a checkpoint
(``save_now``, before a preemption) the ranks agree on the step with one small
all-reduce and save at once, besides the ``--ckpt-every`` cadence, then hold,
training no further, until the supervisor stops them. Rank 0's last
line carries the digest of the final state. ``--fail-at-step N`` (with
``--fail-rank R``) makes rank R raise at the start of step N in every run, once its
last save committed: a deterministic bug, for the tests.

The job spec's loss guard watches the reported loss (``phalanx.guard``): when it trips,
``phalanx.rank.step`` answers ``rollback`` and every rank holds, training no further,
until the supervisor stops it; the generation it restarts restores a checkpoint from
before the spike and skips the steps ``phalanx.rank.next_step`` says (the data position
is the step, so skipping a step skips its batches), with the LR scaled by
``phalanx.rank.lr_scale``. ``--poison-at STEP`` poisons the batches of ``--poison-len``
steps from STEP: their loss is ``--poison-scale`` times the real one (``nan``: NaN), as
a corrupt batch's would be; with ``--poison-returns`` the poison comes back in every
run, at the first steps it trains at or after STEP (a poison no skip gets rid of).

Every ``sdc.every`` steps of the job spec each rank reports the digest of its
parameters (``phalanx.rank.digest``); ``--flip-bit RANK@STEP`` flips one bit of one
parameter of that rank after that step, in the first generation only, as a faulty GPU
would: its replica differs from the others' from then on.

An elastic job (the job spec's ``elastic:``) trains on a dataset of ``--dataset-size``
sequences with the global batch the supervisor gives (``phalanx.rank.elastic()``): each
rank accumulates its micro batches from ``phalanx.rank.ElasticSampler`` (DDP's
all-reduce once per optimizer step), so a gang that shrank or grew trains each step on
the same samples; ``--sample-log DIR`` makes each rank log the sample ids of each step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import phalanx.rank


class TokenStream:
    """Batch ``i`` of a seeded Markov chain over ``vocab`` tokens, without storing it."""

    def __init__(self, vocab: int, seq: int, batch: int, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        # Each token has 4 likely successors: learnable, not trivial.
        self.successors = torch.randint(0, vocab, (vocab, 4), generator=g)
        self.vocab, self.seq, self.batch, self.seed = vocab, seq, batch, seed

    def get(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        out = torch.empty(self.batch, self.seq + 1, dtype=torch.long)
        out[:, 0] = torch.randint(0, self.vocab, (self.batch,), generator=g)
        choice = torch.randint(0, 4, (self.batch, self.seq), generator=g)
        noise = torch.rand(self.batch, self.seq, generator=g) < 0.05
        random_tok = torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)
        for t in range(self.seq):
            nxt = self.successors[out[:, t], choice[:, t]]
            out[:, t + 1] = torch.where(noise[:, t], random_tok[:, t], nxt)
        return out


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim * 4, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        x = self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True)
        out: torch.Tensor = self.head(x)
        return out


def digest(state: dict[str, Any]) -> str:
    """Every bit of a state, as the shard format encodes it (no pickle), hashed."""
    import xxhash

    import ckpt

    return xxhash.xxh3_128_hexdigest(bytes(ckpt.encode(state)))


def capture(
    step: int,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """The whole training state after ``step`` steps; the data position is the step."""
    return {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        },
        "data": {"position": step},
    }


def load(
    state: dict[str, Any],
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    if torch.cuda.is_available() and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return int(state["data"]["position"])


def settle_buckets(
    ddp: DistributedDataParallel, batch: torch.Tensor, loss_fn: nn.Module, vocab: int
) -> None:
    """One forward and backward whose gradients are thrown away, before the first step
    after a restore.

    DDP runs its first iteration with gradient buckets in parameter order, then rebuilds
    them in the order gradients became ready; gloo and NCCL reduce a bucket in chunks,
    so another layout sums each gradient in another order. A run that never stopped
    used the rebuilt layout at this step: without this pass the resumed run would drift
    from it by rounding, and never be bit-identical. It changes no weight and draws
    no random number (no dropout); its gradients are discarded.
    """
    rng = torch.get_rng_state()
    logits = ddp(batch[:, :-1])
    loss_fn(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1)).backward()
    for p in ddp.parameters():
        p.grad = None
    torch.set_rng_state(rng)


def elastic_step(
    ddp: DistributedDataParallel,
    sampler: phalanx.rank.ElasticSampler,
    step: int,
    samples: TokenStream,
    loss_fn: nn.Module,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[float, torch.Tensor, list[int]]:
    """Forward and backward of this rank's micro batches of ``step``, the gradients
    accumulated (averaged: the global batch's mean once DDP averages over the ranks) and
    all-reduced once, at the last. Returns the seconds spent building batches, this
    rank's mean loss and the sample ids it trained on."""
    micro = sampler.micro_batches(step)
    waited, total, ids = 0.0, torch.zeros((), device=device), []
    for i, chunk in enumerate(micro):
        t0 = time.perf_counter()
        batch = torch.stack([samples.get(j)[0] for j in chunk]).to(device)
        waited += time.perf_counter() - t0
        ids.extend(chunk)
        sync = contextlib.nullcontext() if i == len(micro) - 1 else ddp.no_sync()
        with sync:
            logits = ddp(batch[:, :-1])
            loss = loss_fn(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1)) / len(micro)
            loss.backward()
        total += loss.detach()
    return waited, total, ids


def hold_until_stopped() -> None:
    """Wait, training no further, for the stop that follows a save on request."""
    while True:
        time.sleep(1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ckpt-every",
        type=int,
        default=0,
        help="under Phalanx: checkpoint every N steps (0: never)",
    )
    ap.add_argument(
        "--ckpt-digests", action="store_true", help="log a digest of every saved and restored state"
    )
    ap.add_argument(
        "--ckpt-dir",
        default=None,
        help="without an agent: checkpoint standalone under this folder (the tiers in-process)",
    )
    ap.add_argument(
        "--blocking-saves",
        action="store_true",
        help="copy the whole state before save returns (default: lazy saves, the optimizer's "
        "next step waits for the copy)",
    )
    ap.add_argument(
        "--fail-at-step",
        type=int,
        default=None,
        help="test only: --fail-rank raises at the start of this step, every run",
    )
    ap.add_argument("--fail-rank", type=int, default=0, help="the rank --fail-at-step fails")
    ap.add_argument(
        "--poison-at",
        type=int,
        default=None,
        help="test only: the batches of --poison-len steps from this one blow the loss up",
    )
    ap.add_argument("--poison-len", type=int, default=1, help="steps --poison-at poisons")
    ap.add_argument(
        "--poison-scale",
        default="100",
        help="a poisoned batch's loss is this times the real one ('nan': NaN)",
    )
    ap.add_argument(
        "--flip-bit",
        default=None,
        help="test only: RANK@STEP flips one bit of one parameter of that rank after that "
        "step, in the first generation only (a GPU's silent data corruption)",
    )
    ap.add_argument(
        "--poison-returns",
        action="store_true",
        help="the poison comes back in every run, at the first steps trained from --poison-at",
    )
    ap.add_argument(
        "--dataset-size",
        type=int,
        default=96,
        help="an elastic job's dataset: sequences of the token stream (an epoch)",
    )
    ap.add_argument(
        "--sample-log",
        default=None,
        help="an elastic job: each rank appends the sample ids of each optimizer step "
        "it trains to DIR/rank-R.jsonl (with the generation and its layout)",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="train under phalanx.rank.run: when a peer fails, this process stays and "
        "becomes the next generation's rank (the job spec's restart.in_process)",
    )
    ap.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="seconds each step sleeps (a bigger model's pace, for demos and "
        "tests; changes no number)",
    )
    args = ap.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    flip = None
    if args.flip_bit:
        flip_rank, flip_step = args.flip_bit.split("@")
        flip = (int(flip_rank), int(flip_step))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)  # several ranks share a few cores
    if not dist.is_initialized():  # phalanx.rank.run started it (--in-process)
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda") if cuda else torch.device("cpu")
    torch.manual_seed(args.seed)  # identical initial weights on every rank

    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device)
    ddp = DistributedDataParallel(model)
    # Model FLOPs of one training step per token: ~6 per parameter (forward and backward).
    flops_per_token = 6 * sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    stream = TokenStream(args.vocab, args.seq, args.batch)
    elastic = phalanx.rank.elastic()  # None: not an elastic job
    samples = TokenStream(args.vocab, args.seq, 1)  # an elastic job's: one sequence each
    sample_log = None
    sampler = (
        phalanx.rank.ElasticSampler(args.dataset_size, elastic, dp_rank=rank, seed=args.seed)
        if elastic is not None
        else None
    )
    if elastic is not None and args.sample_log:
        os.makedirs(args.sample_log, exist_ok=True)
        sample_log = open(os.path.join(args.sample_log, f"rank-{rank}.jsonl"), "a")  # noqa: SIM115
    loss_fn = nn.CrossEntropyLoss()
    random.seed(args.seed)
    np.random.seed(args.seed)

    checkpointer = None
    start = 0
    if os.environ.get("PHALANX_AGENT_SOCKET") or args.ckpt_dir:
        # The agent's (or, by hand, one under --ckpt-dir); lazy saves unless asked not to.
        where = (
            {}
            if os.environ.get("PHALANX_AGENT_SOCKET")
            else {"dir": os.path.join(args.ckpt_dir, f"rank-{rank}"), "rank": rank}
        )
        checkpointer = phalanx.rank.checkpointer(*(() if args.blocking_saves else (opt,)), **where)
        found = checkpointer.restore()
        if found is not None:
            start = load(found[1], model, opt, sched)
            first = phalanx.rank.next_step(start)
            settle = stream.get(first * world + rank)
            if elastic is not None:
                settle = torch.stack([samples.get(i)[0] for i in range(elastic.micro_batch)])
            settle_buckets(ddp, settle.to(device), loss_fn, args.vocab)
            line: dict[str, Any] = {
                "ckpt_restored": found[0],
                "rank": rank,
                "from": checkpointer.restored_from,
            }
            if args.ckpt_digests:
                line["digest"] = digest(capture(start, model, opt, sched))
            print(json.dumps(line), flush=True)
    saved = False
    # Requests to save now seen by this rank so far, and the most any rank had seen at the
    # last save on request: every rank hears of a request at its own step, so the ranks
    # agree (an all-reduce MAX) and all save at the same step, once per request.
    save_requests = saved_requests = 0

    first_loss = last_loss = math.nan
    window_start, window_tokens = time.perf_counter(), 0
    poisoned = 0  # poisoned steps trained in this run
    step = phalanx.rank.next_step(start)
    if step != start:
        print(json.dumps({"skipped": [start, step], "rank": rank}), flush=True)
    while step < args.steps:
        if step == args.fail_at_step and rank == args.fail_rank:
            if checkpointer is not None and saved:
                # The same run every time: a lazy save's copy still under way when the
                # process dies never commits, and the next generation would restore the
                # step before it (seen under load).
                checkpointer.wait()
            raise RuntimeError(f"injected failure at step {step}")
        if elastic is not None:
            opt.zero_grad(set_to_none=True)
            assert sampler is not None
            waited, loss, ids = elastic_step(ddp, sampler, step, samples, loss_fn, args, device)
            batch = torch.empty(len(ids), args.seq + 1)  # for the token counts below
            if sample_log is not None:
                entry = {
                    "step": step,
                    "rank": rank,
                    "generation": int(os.environ.get("PHALANX_GENERATION", "0")),
                    "dp": elastic.dp_size,
                    "accumulation": elastic.accumulation,
                    "micro_batch": elastic.micro_batch,
                    "ids": ids,
                }
        else:
            waited = time.perf_counter()
            batch = stream.get(step * world + rank).to(device)
            waited = time.perf_counter() - waited
            logits = ddp(batch[:, :-1])
            loss = loss_fn(logits.reshape(-1, args.vocab), batch[:, 1:].reshape(-1))
        if args.poison_at is not None and step >= args.poison_at:
            if args.poison_returns:
                poison = poisoned < args.poison_len
            else:
                poison = step < args.poison_at + args.poison_len
            if poison:
                poisoned += 1
                loss = loss * float(args.poison_scale)
        if elastic is None:
            opt.zero_grad(set_to_none=True)
            loss.backward()
        # read only (the gradients are the all-reduced ones: the same on every rank)
        grad_norm = torch.nn.utils.get_total_norm(
            [p.grad for p in ddp.parameters() if p.grad is not None]
        ).item()
        scale = phalanx.rank.lr_scale(step)
        if scale != 1.0:
            for group in opt.param_groups:
                group["lr"] *= scale
        opt.step()
        if scale != 1.0:
            for group in opt.param_groups:
                group["lr"] /= scale
        sched.step()
        if sample_log is not None:  # the step counted here (a later restore may redo it)
            sample_log.write(json.dumps(entry) + "\n")
            sample_log.flush()
        if flip == (rank, step) and os.environ.get("PHALANX_GENERATION", "1") == "1":
            with torch.no_grad():  # bit 20 of the first weight: no error, a wrong number
                first = next(model.parameters()).view(-1)[:1].view(torch.int32)
                first.bitwise_xor_(1 << 20)
            print(json.dumps({"flipped_bit": step, "rank": rank}), flush=True)
        phalanx.rank.digest(step, model)  # every sdc.every steps (the job spec's)
        window_tokens += batch[:, 1:].numel() * world
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        mean = reduced.item() / world
        if math.isnan(first_loss):
            first_loss = mean
        last_loss = mean
        requests = phalanx.rank.step(
            step,
            loss=mean,
            grad_norm=grad_norm,
            tokens=batch[:, 1:].numel(),  # this rank's: the supervisor sums over ranks
            flops=flops_per_token * batch[:, 1:].numel(),  # for the job's MFU
            lr=sched.get_last_lr()[0] * scale,
            data_wait_s=waited,
        )
        if requests.rollback:
            # The loss guard tripped: the supervisor rolls the gang back; the weights are
            # the spike's, so nothing more is trained or saved.
            print(json.dumps({"guard_tripped": step, "rank": rank, "loss": mean}), flush=True)
            hold_until_stopped()
        if requests.save_now:
            save_requests += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            now = time.perf_counter()
            rate = window_tokens / max(now - window_start, 1e-9)
            print(
                json.dumps(
                    {
                        "step": step,
                        "loss": round(mean, 4),
                        "tokens_per_s": round(rate),
                        "lr": sched.get_last_lr()[0],
                        **({"lr_scale": scale} if scale != 1.0 else {}),
                    }
                ),
                flush=True,
            )
            window_start, window_tokens = now, 0
        done = step + 1
        on_request = False
        if checkpointer is not None:
            agreed = torch.tensor([save_requests], device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            if int(agreed.item()) > saved_requests:
                saved_requests, on_request = int(agreed.item()), True
        if checkpointer is not None and (
            on_request or (args.ckpt_every and done % args.ckpt_every == 0)
        ):
            state = capture(done, model, opt, sched)
            if args.ckpt_digests:  # before the save: a rank killed right after it left one
                print(
                    json.dumps({"ckpt_saved": done, "rank": rank, "digest": digest(state)}),
                    flush=True,
                )
            checkpointer.save(done, state)
            saved = True
            if on_request:
                # The supervisor asks before it stops the job (a preemption): train no
                # further, so no step is trained twice when the job resumes from this one.
                print(
                    json.dumps({"ckpt_saved_on_request": done, "rank": rank, "holding": True}),
                    flush=True,
                )
                hold_until_stopped()
        step = phalanx.rank.next_step(step + 1)
    phalanx.rank.finished(args.steps)  # the final wait and barrier are no hang
    if checkpointer is not None:
        if saved:
            checkpointer.wait()
        checkpointer.close()
    if rank == 0:
        print(
            json.dumps(
                {
                    "done": True,
                    "steps": args.steps,
                    "first_loss": round(first_loss, 4),
                    "last_loss": round(last_loss, 4),
                    "improved": last_loss < first_loss,
                    "digest": digest(capture(args.steps, model, opt, sched)),
                }
            ),
            flush=True,
        )
    dist.barrier()  # no rank tears down (rank 0 hosts the rendezvous store) before all are done
    dist.destroy_process_group()


def exit_now() -> None:
    """End the process without finalizing the interpreter.

    gloo's worker threads outlive ``destroy_process_group`` while DDP holds the
    group; one that frees its last collective (tensors with Python objects) after
    the interpreter began to finalize takes the GIL, is made to exit inside a C++
    destructor and aborts the rank: "terminate called without an active
    exception", signal 6, after a run that succeeded (pytorch#179291; a barrier
    first only moved it into the barrier's own work). Nothing is left to finalize.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if "--in-process" in sys.argv:
        phalanx.rank.run(main)
    else:
        main()
    exit_now()
