"""Lazy saves (``Checkpointer.attach``): the copy of the optimizer's tensors runs behind the
training loop and the optimizer's next step waits for it. Real models, real optimizers,
real RAM and disk tiers; the copy is held back (``HeldCopy``) where a test needs it to be
in flight, by wrapping the copier's one host copy function."""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckpt.checkpointer
import ckpt.lazy
from ckpt import Checkpointer, CheckpointError, ShardKey, encode, plan, seal, write_into
from ckpt._tree import Blob
from ckpt.lazy import Copier, Copy
from tests.unit.ckpt.helpers import assert_bit_identical, open_ckpt

REPO = Path(__file__).resolve().parents[3]


class HeldCopy:
    """The copier's host copies wait for ``gate`` (``entered`` says one is waiting)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls = 0
        real = ckpt.lazy.copy_host

        def held(dst: torch.Tensor, src: torch.Tensor) -> None:
            self.calls += 1
            self.entered.set()
            assert self.gate.wait(30), "the test never let the copy go"
            real(dst, src)

        monkeypatch.setattr(ckpt.lazy, "copy_host", held)
        self.fencing = threading.Event()  # a fence has been entered (see ``watch``)
        self.monkeypatch = monkeypatch

    def watch(self, c: Checkpointer) -> None:
        """Set ``fencing`` when a fence of ``c`` starts waiting (an optimizer step's too)."""
        real = c.lazy.copier.fence

        def fence(timeout: float) -> float | None:
            self.fencing.set()
            return real(timeout)

        self.monkeypatch.setattr(c.lazy.copier, "fence", fence)

    def release_once_fenced(self) -> None:
        """Let the copy go once a fence waits for it (from a thread of its own)."""

        def run() -> None:
            assert self.fencing.wait(30)
            time.sleep(0.05)
            self.gate.set()

        threading.Thread(target=run, daemon=True).start()


class Trainer:
    """A small model with a BatchNorm (a buffer the forward pass changes) under Adam."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4)
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.step()  # Adam's state exists from here

    def forward_backward(self) -> None:
        loss = self.model(torch.randn(16, 32)).square().mean()
        self.opt.zero_grad()
        loss.backward()

    def step(self) -> None:
        self.forward_backward()
        self.opt.step()

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "rng": torch.get_rng_state(),
            "loader": {"index": 7},
        }


def snapshot(state: Any) -> bytes:
    """Every bit of ``state`` as it is now."""
    return bytes(encode(state))


def restored(c: Checkpointer, step: int) -> Any:
    c.wait()
    found = c.restore(step)
    assert found is not None and found[0] == step
    return found[1]


def test_a_lazy_save_keeps_the_state_of_the_call_though_the_optimizer_steps_right_after(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldCopy(monkeypatch)
    t = Trainer()
    c = open_ckpt(ckpts, tmp_path).attach(t.opt)
    held.watch(c)
    state = t.state()
    before = snapshot(state)

    assert c.save(1, state)
    assert held.entered.wait(10) and c.copying  # the parameters are not copied yet
    stepping = threading.Thread(target=t.step)
    stepping.start()
    assert held.fencing.wait(30)
    stepping.join(0.3)
    assert stepping.is_alive()  # the optimizer's step waits for the copy ...
    held.gate.set()
    stepping.join(10)
    assert not stepping.is_alive()
    t.step()  # ... and then the parameters change

    assert snapshot(t.state()) != before
    assert snapshot(restored(c, 1)) == before
    assert len(c.fence_waits) == 1


def test_an_optimizer_step_after_the_copy_finished_does_not_wait(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldCopy(monkeypatch)
    held.gate.set()
    t = Trainer()
    c = open_ckpt(ckpts, tmp_path).attach(t.opt)
    state = t.state()
    before = snapshot(state)

    c.save(1, state)
    c.wait()  # the copy is done, and the write-down too
    t.step()

    assert held.calls > 0 and not c.copying
    assert c.fence_waits == []
    assert snapshot(restored(c, 1)) == before


def test_fence_waits_for_the_copy_before_an_in_place_edit(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldCopy(monkeypatch)
    t = Trainer()
    c = open_ckpt(ckpts, tmp_path).attach(t.opt)
    state = t.state()
    before = snapshot(state)
    c.save(1, state)
    assert held.entered.wait(10)

    fencing = threading.Thread(target=c.fence)
    fencing.start()
    fencing.join(0.3)
    assert fencing.is_alive()
    held.gate.set()
    fencing.join(10)
    assert not fencing.is_alive() and not c.copying
    with torch.no_grad():  # an EMA-like in-place update of the parameters
        for p in t.model.parameters():
            p.mul_(0.5)

    assert snapshot(restored(c, 1)) == before


def test_values_the_optimizer_does_not_own_are_copied_at_the_save_call(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldCopy(monkeypatch)
    t = Trainer()
    c = open_ckpt(ckpts, tmp_path).attach(t.opt)
    extra = torch.arange(8.0)  # a tensor of no attached optimizer
    array = np.arange(4)
    data = bytearray(b"position")
    state = {**t.state(), "extra": extra, "array": array, "data": data}
    before = snapshot(state)
    c.save(1, state)
    assert held.entered.wait(10)  # the parameters' copy is in flight

    t.forward_backward()  # BatchNorm's running statistics change in the forward pass
    extra.add_(1)
    array += 1
    data[:] = b"elsewhe!"
    torch.manual_seed(123)  # the RNG moves on (its state was a new tensor anyway)
    held.gate.set()

    assert snapshot(restored(c, 1)) == before


def test_without_attach_save_copies_the_whole_state_before_it_returns(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldCopy(monkeypatch)
    t = Trainer()
    c = open_ckpt(ckpts, tmp_path)
    state = t.state()
    before = snapshot(state)

    c.save(1, state)
    assert not c.copying and held.calls == 0
    t.step()  # nothing waits, nothing needs to

    assert snapshot(restored(c, 1)) == before


def test_a_copy_that_fails_is_raised_by_the_next_step_and_its_slot_takes_the_next_save(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fails(dst: torch.Tensor, src: torch.Tensor) -> None:
        raise OSError("injected: the copy into the RAM slot failed")

    hand_back = ckpt.checkpointer.to_engine

    def slow_hand_back(*args: Any) -> Callable[[BaseException | None], None]:
        finish = hand_back(*args)

        def slow(error: BaseException | None) -> None:
            time.sleep(0.3)  # the step's fence must not wait for the slot's hand-back
            finish(error)

        return slow

    t = Trainer()
    c = open_ckpt(ckpts, tmp_path, ram_slots=2).attach(t.opt)
    monkeypatch.setattr(ckpt.lazy, "copy_host", fails)
    monkeypatch.setattr(ckpt.checkpointer, "to_engine", slow_hand_back)
    assert c.save(1, t.state())

    with pytest.raises(CheckpointError, match=r"step 1 .* not saved"):
        t.step()
    monkeypatch.undo()
    t.step()  # raised once
    state = t.state()
    before = snapshot(state)
    for step in (2, 3):  # every slot is free again
        c.save(step, state)
        c.wait()

    assert 1 not in c.ram.steps("local") and 1 not in c.tiers[0].steps("local")
    assert snapshot(restored(c, 3)) == before


def test_close_finishes_the_copy_and_removes_the_optimizers_hook(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldCopy(monkeypatch)
    t = Trainer()
    c = open_ckpt(ckpts, tmp_path).attach(t.opt, t.opt)  # attached once
    assert len(t.opt._optimizer_step_pre_hooks) == 1
    state = t.state()
    before = snapshot(state)
    c.save(1, state)
    held.gate.set()

    c.close()

    assert len(t.opt._optimizer_step_pre_hooks) == 0
    fresh = open_ckpt(ckpts, tmp_path)
    found = fresh.restore()
    assert found is not None and found[0] == 1 and snapshot(found[1]) == before


def test_attach_refuses_what_is_not_an_optimizer(tmp_path: Path, ckpts: list[Checkpointer]) -> None:
    c = open_ckpt(ckpts, tmp_path)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        c.attach(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_the_auto_interval_counts_the_wait_of_the_step_after_a_lazy_save(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldCopy(monkeypatch)
    t = Trainer()
    c = open_ckpt(ckpts, tmp_path, interval="auto", mtbf_s=3600.0).attach(t.opt)
    held.watch(c)
    c.save(1, t.state())
    assert held.entered.wait(10)
    held.release_once_fenced()
    t.step()

    assert c.policy.stall_s == pytest.approx(c.stalls[0] + c.fence_waits[0])


KILLED_MID_COPY = """
import sys, time, torch, xxhash
import ckpt.checkpointer
import ckpt.lazy
from ckpt import Checkpointer, encode
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
def step():
    model(torch.randn(8, 256)).square().mean().backward()
    opt.step()
def state():
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}
step()
c = Checkpointer(dir=sys.argv[1], tiers=["disk"]).attach(opt)
c.save(1, state())
c.wait()
print("committed", c.ram.namespace, xxhash.xxh3_128_hexdigest(bytes(encode(state()))), flush=True)
step()
def torn(dst, src):  # half of the first tensor copied, then the rank is killed
    half = dst.numel() // 2
    dst.reshape(-1)[:half].copy_(src.reshape(-1)[:half])
    print("copying", flush=True)
    time.sleep(60)
ckpt.lazy.copy_host = torn
c.save(2, state())
time.sleep(60)
"""


def test_a_rank_killed_during_the_copy_leaves_the_previous_step_and_never_the_torn_one(
    tmp_path: Path,
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(KILLED_MID_COPY), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("committed"), line
        _, namespace, digest = line.split()
        assert child.stdout.readline().strip() == "copying"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    heads = {}  # the slots the killed rank left: step -> state (1 writing, 2 sealed)
    for path in Path("/dev/shm").glob(f"{namespace}.slot*"):
        _magic, _version, slot_state, step, *_ = struct.unpack(
            "<8sIIqQQQ16s", path.read_bytes()[:64]
        )
        heads[step] = slot_state
    assert heads == {1: 2, 2: 1}  # step 2's slot was never sealed

    fresh = Checkpointer(dir=tmp_path, tiers=["disk"])
    try:
        assert fresh.ram.steps("local") == [1] and fresh.tiers[0].steps("local") == [1]
        found = fresh.restore()
        assert found is not None and found[0] == 1
        import xxhash

        assert xxhash.xxh3_128_hexdigest(bytes(encode(found[1]))) == digest
    finally:
        fresh.close()
        fresh.ram.unlink()


def test_two_views_of_one_parameter_are_both_captured_by_a_lazy_save(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    t = Trainer()
    c = open_ckpt(ckpts, tmp_path).attach(t.opt)
    weight = t.model[0].weight
    state = {"a": weight.detach(), "b": weight.detach(), "opt": t.opt.state_dict()}
    before = snapshot(state)
    c.save(1, state)
    t.step()

    got = restored(c, 1)
    assert snapshot(got) == before
    assert_bit_identical(got["a"], got["b"])


def test_the_ranks_checkpointer_is_made_once_and_attaches_each_calls_optimizers(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    import phalanx.rank

    monkeypatch.setattr(phalanx.rank, "_checkpointer", None)
    first, second = Trainer(), Trainer()
    c = phalanx.rank.checkpointer(first.opt, dir=tmp_path)
    ckpts.append(c)

    assert phalanx.rank.checkpointer(second.opt) is c
    assert c.lazy.optimizers == [first.opt, second.opt]
    c.close()
    again = phalanx.rank.checkpointer(dir=tmp_path / "again")  # a closed one is made anew
    ckpts.append(again)
    assert again is not c and not again.lazy.attached


class FakeCuda:
    """The few CUDA calls the copier makes, logging each in order (this machine has no GPU):
    events, streams, the current-stream context. An end event's ``synchronize`` (the host
    waiting for the GPU) holds until ``gpu_done`` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, ...]] = []
        self.gpu_done = threading.Event()
        self.current = threading.local()
        self.events = 0
        fake = self

        class Stream:
            def __init__(self, name: str = "side", device: Any = None) -> None:
                self.name = name

            def wait_event(self, event: Any) -> None:
                fake.log.append(("wait", self.name, event.name))

        class Event:
            def __init__(self) -> None:
                fake.events += 1
                self.name = "ready" if fake.events == 1 else "end"

            def record(self, stream: Any) -> None:
                fake.log.append(("record", self.name, stream.name))

            def synchronize(self) -> None:
                assert fake.gpu_done.wait(10)
                fake.log.append(("synchronize", self.name))

        @contextlib.contextmanager
        def stream(s: Any) -> Iterator[None]:
            fake.current.stream = s
            try:
                yield
            finally:
                fake.current.stream = None

        self.training = Stream("training")
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: self.training)


class FakeCudaTensor:
    """A parameter on GPU 0, as far as the copier looks at it."""

    device = torch.device("cuda:0")

    def __init__(self, name: str, cuda: FakeCuda) -> None:
        self.name, self.cuda = name, cuda

    def record_stream(self, stream: Any) -> None:
        self.cuda.log.append(("record_stream", self.name, stream.name))


def test_cuda_copies_run_on_a_side_stream_after_the_training_streams_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda = FakeCuda(monkeypatch)

    class Target:
        def __init__(self, blob: Blob) -> None:
            self.blob = blob

        def copy_(self, src: FakeCudaTensor, non_blocking: bool = False) -> None:
            stream = getattr(cuda.current, "stream", None)
            assert non_blocking and stream is not None
            cuda.log.append(("copy", src.name, stream.name))

    monkeypatch.setattr(ckpt.lazy.Copy, "target", lambda self, blob: Target(blob))
    blobs = [
        Blob("tensor", FakeCudaTensor(name, cuda), "float32", (4,), 64 * i, 16)
        for i, name in enumerate(["w", "exp_avg"])
    ]
    handed: list[BaseException | None] = []
    copy = Copy(ShardKey("j", 1, 0), blobs, memoryview(bytearray(128)), 0, handed.append)
    copier = Copier("ckpt-copy-test")

    copier.start(copy)
    assert cuda.log[0] == ("record", "ready", "training")  # at the save call
    assert copy.issued.wait(10)
    assert copier.fence(10) is None  # the host does not wait for the GPU ...
    assert cuda.log[-1] == ("wait", "training", "end")  # ... the training stream does
    assert handed == [] and copier.busy()  # the slot is not handed on before the GPU is done
    cuda.gpu_done.set()
    copier.close(10)

    assert handed == [None]
    assert cuda.log == [
        ("record", "ready", "training"),
        ("wait", "side", "ready"),
        ("copy", "w", "side"),
        ("record_stream", "w", "side"),
        ("copy", "exp_avg", "side"),
        ("record_stream", "exp_avg", "side"),
        ("record", "end", "side"),
        ("wait", "training", "end"),
        ("synchronize", "end"),
    ]


def test_a_shard_laid_without_its_deferred_tensors_then_given_them_is_the_shard_of_encode() -> None:
    state = {"a": torch.arange(10.0), "b": torch.ones(3, 5, dtype=torch.int64)[:, 1], "c": b"x"}
    shard_plan = plan(state)
    buffer = bytearray(b"\xff" * shard_plan.nbytes)  # a slot with an older save's bytes

    deferred = write_into(shard_plan, buffer, defer=lambda blob: blob.kind == "tensor")
    assert len(deferred) == 2
    assert deferred[0].value is state["a"] and deferred[1].value is state["b"]
    copy = Copy(ShardKey("j", 1, 0), deferred, memoryview(buffer), len(shard_plan.head), print)
    for blob in deferred:  # one dense, one strided (through copy_)
        ckpt.lazy.copy_host(copy.target(blob), blob.value)
    seal(buffer)

    assert bytes(buffer) == bytes(encode(state))
