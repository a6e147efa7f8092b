"""Lazy saves: ``save`` starts the copy into the RAM slot, the optimizer step waits for it.

Parameters and optimizer state do not change during a forward and backward pass; they
change when the optimizer steps. So once ``Checkpointer.attach(optimizer)`` has named
the optimizers, a save copies their tensors behind the training loop, and a pre-hook on
each optimizer's step (``register_step_pre_hook``) waits for that copy before a single
parameter or state value changes (DataStates-LLM, Maurya et al., calls such snapshots
lazy).

What is copied when:

* At the ``save`` call, on the training thread: the shard's header (the tree, every Python
  value in it), and every blob whose storage is not an attached optimizer's parameter or
  state: buffers (a forward pass changes BatchNorm's statistics), RNG states, numpy
  arrays, bytes, tensors of no attached optimizer. What the next forward pass may change
  is captured before ``save`` returns.
* Behind it, by the copier thread (``ckpt-copy-rN``): the optimizers' tensors (the
  *deferred* blobs). A CPU tensor is copied with ``memmove`` in 64 MiB pieces (one core,
  the GIL released). A CUDA tensor is copied on a side stream of its device: at ``save``
  an event is recorded on the device's current (training) stream, and the side stream
  waits for that event, so the copy reads what the work queued before ``save`` leaves;
  each copy is ``non_blocking`` into the slot (pinned for DMA by ``ckpt.ram``), each
  source is marked with ``record_stream`` (the caching allocator never hands its memory
  to another tensor before the side stream's copy is done), and the plan holds every
  source until that copy has completed. An event recorded on the side stream after the
  copies marks the end; the copier waits for it on the host.
* Only then is the slot handed on (to the engine's seal, or to the agent's submit): the
  write-down starts after the copy, the commit protocol is the same, and a slot whose
  copy did not finish is never sealed. A rank killed mid-copy leaves its slot marked
  ``writing``: nothing a restore would read.

``fence`` (the pre-hook calls it) waits for every copy in flight: on the host for CPU
tensors; for CUDA tensors it makes the current stream wait for the copy's end event,
so the optimizer's kernels run after the copy without the host waiting. It returns at
once when the copies are done. Anything else that changes saved tensors in place before
the next optimizer step must call it first: an EMA update of the parameters, a user's
in-place edit, ``load_state_dict`` (``Checkpointer.restore`` fences by itself).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Self

from ckpt.errors import CheckpointError
from ckpt.tiers import ShardKey

if TYPE_CHECKING:  # torch is imported by the first attach (``import ckpt`` does not)
    import torch

    from ckpt._tree import Blob
    from ckpt.engine import Engine
    from ckpt.ram import RamTier, Slot
    from ckpt.remote import AgentClient

__all__ = ["Copier", "Copy", "LazySaves", "LazySaving", "guarded_storages"]

log = logging.getLogger(__name__)

PIECE: Final = 64 << 20  # bytes a memmove copies with the GIL released
LAZY_DEVICES: Final = frozenset({"cpu", "cuda"})

StorageKey = tuple[str, int]
Finish = Callable[[BaseException | None], None]


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """Where a tensor's storage is: its device and first byte (two live storages never share
    it). A DTensor's is its local shard's (what a rank saves of it); ``None`` for a tensor
    with no storage to name (a subclass that hides it): never guarded, copied at the call."""
    local = getattr(tensor, "_local_tensor", None)  # a DTensor (FSDP2, tensor parallel)
    if local is not None:
        tensor = local
    try:
        return str(tensor.device), int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def guarded_storages(optimizers: Iterable[torch.optim.Optimizer]) -> set[StorageKey]:
    """The storages that change only when one of ``optimizers`` steps: its parameters' and
    its state's tensors (Adam's moments, its ``step`` counts). Read at each save: an
    optimizer makes its state at its first step."""
    import torch

    found: list[StorageKey | None] = []
    for opt in optimizers:
        for group in opt.param_groups:
            found += (storage_key(p) for p in group["params"])
        for per_param in opt.state.values():
            if isinstance(per_param, Mapping):
                found += (storage_key(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return {key for key in found if key is not None}


def deferrable(keys: set[StorageKey]) -> Callable[[Blob], bool]:
    """``write_into``'s ``defer``: a tensor blob (CPU or CUDA) whose storage is guarded."""
    import torch

    def defer(blob: Blob) -> bool:
        value = blob.value
        return (
            blob.kind == "tensor"
            and isinstance(value, torch.Tensor)
            and value.device.type in LAZY_DEVICES
            and value.untyped_storage().nbytes() > 0
            and storage_key(value) in keys
        )

    return defer


@dataclass(eq=False)
class Copy:
    """One save's deferred blobs on their way into its slot's ``view``."""

    key: ShardKey
    blobs: list[Blob]
    view: memoryview  # the shard's bytes in the slot
    data_start: int
    finish: Finish  # hand the slot on (None) or give it back (the error); from the copier
    ready: dict[torch.device, Any] = field(default_factory=dict)  # CUDA events at save
    ended: dict[torch.device, Any] = field(default_factory=dict)  # CUDA events after copies
    issued: threading.Event = field(default_factory=threading.Event)  # CUDA copies queued
    host_done: threading.Event = field(default_factory=threading.Event)  # CPU copies done
    done: threading.Event = field(default_factory=threading.Event)  # all done, slot handed on
    error: BaseException | None = None
    reported: bool = False

    def target(self, blob: Blob) -> torch.Tensor:
        """The blob's place in the slot, as a tensor of its dtype and shape."""
        import torch

        from ckpt._tree import TORCH_DTYPES

        start = self.data_start + blob.offset
        flat = torch.frombuffer(self.view, dtype=torch.uint8, count=blob.nbytes, offset=start)
        return flat.view(TORCH_DTYPES[blob.dtype]).view(blob.shape)


def copy_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for a CPU ``src``, in ``memmove`` pieces where it is one dense run
    of bytes (one core, the GIL released between pieces and inside each)."""
    if not src.is_contiguous() or src.is_conj() or src.is_neg():
        dst.copy_(src)
        return
    to, start, nbytes = dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size()
    for offset in range(0, nbytes, PIECE):
        ctypes.memmove(to + offset, start + offset, min(PIECE, nbytes - offset))


def to_engine(ram: RamTier, engine: Engine, slot: Slot, key: ShardKey) -> Finish:
    """A standalone save's ``finish``: the slot to the engine (which seals it and writes it
    down), or back to the RAM tier empty when the copy failed."""

    def finish(error: BaseException | None) -> None:
        if error is not None:
            ram.release(slot, keep_content=False)
            return
        try:
            engine.submit(slot, key)
        except BaseException:
            ram.release(slot, keep_content=False)  # never left busy
            raise

    return finish


def to_agent(agent: AgentClient, step: int, slot: int, nbytes: int) -> Finish:
    """A save under Phalanx's ``finish``: submitted to the agent, or aborted there."""

    def finish(error: BaseException | None) -> None:
        if error is None:
            agent.submit(step, slot, nbytes)
            return
        with contextlib.suppress(CheckpointError):
            agent.submit(step, slot, nbytes, abort=True)

    return finish


class Copier:
    """The copier thread of one ``Checkpointer`` and the copies in flight, in save order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.pending: list[Copy] = []
        self.queue: queue.SimpleQueue[Copy | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.streams: dict[torch.device, Any] = {}  # the side stream of each CUDA device

    # ----------------------------------------------------------------- training thread

    def start(self, copy: Copy) -> None:
        """Queue ``copy``; for its CUDA blobs, mark where the training streams are now."""
        import torch

        for device in {b.value.device for b in copy.blobs if b.value.device.type == "cuda"}:
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(torch.cuda.current_stream(device))
            copy.ready[device] = ready
        with self.lock:
            self.pending.append(copy)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, args=(cuda_device(),), name=self.name, daemon=True
                )
                self.thread.start()
        self.queue.put(copy)

    def busy(self) -> bool:
        """Whether a copy is still in flight."""
        with self.lock:
            return any(not c.done.is_set() for c in self.pending)

    def fence(self, timeout: float) -> float | None:
        """Wait for the copies in flight (see the module docstring); the seconds the host
        waited, ``None`` when every copy had finished on the host already. Raises the
        ``CheckpointError`` of a copy that failed."""
        with self.lock:
            pending = [c for c in self.pending if not c.done.is_set()]
        held = False
        start = time.perf_counter()
        for copy in pending:
            if not (copy.issued.is_set() and copy.host_done.is_set()):
                held = True
            if not copy.issued.wait(timeout):
                raise TimeoutError(
                    f"the copy of step {copy.key.step} was not started on its side stream "
                    f"within {timeout:g} s"
                )
            for device, ended in copy.ended.items():
                sys.modules["torch"].cuda.current_stream(device).wait_event(ended)
            if not copy.host_done.wait(timeout):
                raise TimeoutError(
                    f"the copy of step {copy.key.step} into its RAM slot took over {timeout:g} s"
                )
        waited = time.perf_counter() - start
        self.check()
        return waited if held else None

    def drain(self, timeout: float) -> None:
        """Wait until every copy is done and its slot handed on (the host waits for the
        CUDA copies too); raises the error of a copy that failed."""
        deadline = time.monotonic() + timeout
        with self.lock:
            pending = list(self.pending)
        for copy in pending:
            if not copy.done.wait(max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(
                    f"the copy of step {copy.key.step} into its RAM slot was not done "
                    f"within {timeout:g} s"
                )
        self.check()

    def check(self) -> None:
        """Forget the copies that are done; raise the first that failed (once). A copy
        that failed is raised as soon as its error is known, before its slot is handed
        back: ``fence`` waits for the host's copies, not for that hand-back, and the
        error must reach the optimizer step that fence guards."""
        with self.lock:
            done = [c for c in self.pending if c.done.is_set()]
            failing = [c for c in self.pending if c.error is not None]
            self.pending = [c for c in self.pending if not c.done.is_set()]
        failed = next((c for c in done + failing if c.error is not None and not c.reported), None)
        if failed is None:
            return
        failed.reported = True
        raise CheckpointError(
            f"the copy of step {failed.key.step} into its RAM slot failed, so that step was "
            f"not saved: {failed.error!r}",
            ref=failed.key.ref(),
        ) from failed.error

    def close(self, timeout: float) -> None:
        """Finish the copies in flight, then stop the thread."""
        try:
            self.drain(timeout)
        finally:
            with self.lock:
                thread, self.thread = self.thread, None
            if thread is not None:
                self.queue.put(None)
                thread.join(timeout)

    # ----------------------------------------------------------------- copier thread

    def _run(self, device: int | None) -> None:
        import torch

        if device is not None:  # a thread starts on GPU 0: never open a context there
            torch.cuda.set_device(device)
        while (copy := self.queue.get()) is not None:
            self._copy(copy)

    def _copy(self, copy: Copy) -> None:
        import torch

        used: list[Any] = []
        try:
            with torch.no_grad():
                self._issue_cuda(copy, used)
                copy.issued.set()
                for blob in copy.blobs:
                    if blob.value.device.type == "cpu":
                        copy_host(copy.target(blob), blob.value)
                copy.host_done.set()
                for ended in copy.ended.values():
                    ended.synchronize()
        except BaseException as exc:
            copy.error = exc
            log.error("the copy of step %d into its RAM slot failed: %r", copy.key.step, exc)
            for stream in used:  # nothing may still write into a slot given back
                with contextlib.suppress(Exception):
                    stream.synchronize()
        finally:
            copy.issued.set()
            copy.host_done.set()
            try:
                copy.finish(copy.error)
            except BaseException as exc:
                log.error("handing on the slot of step %d failed: %r", copy.key.step, exc)
                if copy.error is None:
                    copy.error = exc
            copy.blobs = []  # the sources may go now: every copy from them is complete
            copy.ready.clear()
            with contextlib.suppress(BufferError):
                copy.view.release()
            copy.done.set()

    def _issue_cuda(self, copy: Copy, used: list[Any]) -> None:
        """Queue the CUDA blobs' copies on each device's side stream, after the event
        recorded at ``save`` on its training stream, then an event that marks their end."""
        import torch

        for device, ready in copy.ready.items():
            side = self.streams.get(device)
            if side is None:
                side = self.streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            used.append(side)
            with torch.cuda.device(device):
                side.wait_event(ready)
                with torch.cuda.stream(side):
                    for blob in copy.blobs:
                        if blob.value.device == device:
                            copy.target(blob).copy_(blob.value, non_blocking=True)
                            blob.value.record_stream(side)
                ended = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ended.record(side)
            copy.ended[device] = ended


def cuda_device() -> int | None:
    """The calling thread's current CUDA device, where this process uses CUDA (a thread
    starts on device 0: a slot pinned from one, or a stream made there, would open a
    context on GPU 0)."""
    torch_ = sys.modules.get("torch")
    if torch_ is None or not torch_.cuda.is_available() or not torch_.cuda.is_initialized():
        return None
    return int(torch_.cuda.current_device())


class LazySaves:
    """The attached optimizers of one ``Checkpointer``, their pre-hooks and its copier."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []
        self.handles: list[Any] = []
        self.copier = Copier(name)
        self.timeout_s = timeout_s
        # Seconds each fence held the host for an unfinished copy (none when it was done).
        self.fence_waits: list[float] = []
        self.on_wait: Callable[[float], None] | None = None  # the policy learns the cost

    def attach(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        import torch

        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"attach() takes torch.optim.Optimizer objects, not {type(opt).__qualname__}"
                )
            if any(opt is known for known in self.optimizers):
                continue
            self.optimizers.append(opt)
            self.handles.append(opt.register_step_pre_hook(self._pre_step))

    def _pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.fence()

    @property
    def attached(self) -> bool:
        return bool(self.optimizers)

    def defer(self) -> Callable[[Blob], bool]:
        return deferrable(guarded_storages(self.optimizers))

    def fence(self) -> None:
        waited = self.copier.fence(self.timeout_s)
        if waited is not None:
            self.fence_waits.append(waited)
            if self.on_wait is not None:
                self.on_wait(waited)

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.optimizers.clear()


class LazySaving:
    """The lazy-save half of ``Checkpointer``'s API (it owns ``self.lazy``)."""

    lazy: LazySaves

    def attach(self, *optimizers: torch.optim.Optimizer) -> Self:
        """Make saves lazy: ``save`` returns once the copy of these optimizers' tensors
        (their parameters and state) into the RAM slot is started, and a pre-hook on
        each optimizer's ``step`` waits for that copy before anything changes. The rest
        of the state (buffers, RNG states, the loader's position, Python values) is
        copied at the ``save`` call, as without it. Returns the ``Checkpointer``, so
        ``ck = Checkpointer().attach(opt)`` is one line. See ``fence`` for what else
        must wait for the copy."""
        self.lazy.attach(optimizers)
        return self

    def detach(self) -> None:
        """Wait for the copy in flight and make saves blocking again."""
        self.fence()
        self.lazy.detach()

    def fence(self) -> None:
        """Wait for the copy of the last lazy save (at once when it is done).

        The attached optimizers call it before they step. Anything else that changes
        a saved tensor in place before the next optimizer step must call it first: an
        EMA update of the parameters, a user's in-place edit of a parameter or of the
        optimizer's state, ``load_state_dict`` into the model (``restore`` fences by
        itself). Gradient clipping and ``zero_grad`` change no saved tensor. On a GPU
        it makes the current stream wait for the copy (the host does not wait); on the
        CPU the host waits. Raises the ``CheckpointError`` of a copy that failed (that
        step is not saved)."""
        self.lazy.fence()

    @property
    def copying(self) -> bool:
        """Whether the copy of a lazy save is still in flight."""
        return self.lazy.copier.busy()

    @property
    def fence_waits(self) -> list[float]:
        """Seconds each fence (an optimizer step's included) waited for an unfinished copy."""
        return self.lazy.fence_waits
