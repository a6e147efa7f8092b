"""RAM-tier slots pinned for DMA on a GPU node: every registration is undone before its
mapping goes. Against ``FakeCudart``, a hand-written stand-in for the two CUDA runtime
calls (this machine has no GPU); it holds CUDA's rules: an address registers once, and
only a registered, still-mapped address unregisters."""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt import RamTier, ShardKey
from ckpt.remote import AgentClient, AgentEnv

ALREADY_REGISTERED, NOT_REGISTERED = 712, 713  # cudaErrorHostMemory{Already,Not}Registered


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False


class FakeCudart:
    """``torch.cuda.cudart()``'s host-register calls, keeping what is registered."""

    def __init__(self, refuse_with: int = 0) -> None:
        self.refuse_with = refuse_with
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        if self.refuse_with:
            return self.refuse_with
        if address in self.registered:
            return ALREADY_REGISTERED
        assert mapped(address) and flags == 1  # portable: every context sees it pinned
        self.registered[address] = nbytes
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        if address not in self.registered:
            return NOT_REGISTERED
        assert mapped(address), "unregistered after its mapping was closed"
        del self.registered[address]
        self.unregistered.append(address)
        return 0


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


@pytest.fixture
def shm() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/dev/shm") as folder:
        yield Path(folder)


def acquire(ram: RamTier, *sizes: int) -> None:
    """One slot for each size, all held at once, then let go."""
    slots = [
        ram.acquire(ShardKey("j", step, 0), n, when_busy="skip", timeout=1)
        for step, n in enumerate(sizes, start=1)
    ]
    for slot in slots:
        assert slot is not None
        ram.release(slot, keep_content=False)


def test_a_slot_that_grows_unpins_its_old_mapping_before_unmapping_it(
    cuda: FakeCudart, shm: Path
) -> None:
    ram = RamTier("phalanx-j-r0", job="j", directory=shm, slots=2, keep=1)
    acquire(ram, 1 << 20, 1 << 20)
    first = set(cuda.registered)
    assert len(first) == 2

    acquire(ram, 8 << 20)  # bigger than the slot it gets: remapped

    assert len(cuda.unregistered) == 1 and cuda.unregistered[0] in first
    assert len(cuda.registered) == 2 and max(cuda.registered.values()) > 8 << 20
    ram.unlink()
    assert cuda.registered == {}


def test_a_refused_pin_is_logged_and_the_slot_still_takes_a_save(
    monkeypatch: pytest.MonkeyPatch, shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeCudart(refuse_with=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    ram = RamTier("phalanx-j-r0", job="j", directory=shm, slots=2, keep=1)

    with caplog.at_level(logging.WARNING, logger="ckpt.ram"):
        slot = ram.acquire(ShardKey("j", 1, 0), 4096, when_busy="skip", timeout=1)
    assert slot is not None and slot.pinned is None
    slot.view(4096)[:] = b"x" * 4096
    ram.release(slot)
    ram.unlink()

    assert "CUDA error 2" in caplog.text
    assert fake.unregistered == []  # nothing pinned, nothing to undo


def test_a_rank_whose_agent_slot_grew_unpins_its_old_map(cuda: FakeCudart, shm: Path) -> None:
    path = shm / "phalanx-j-r0.slot0"
    path.write_bytes(bytes(1 << 20))
    client = AgentClient(AgentEnv(str(shm / "agent.sock"), "j", 1, 0, 1))

    old = client.map_slot(str(path))
    assert client.map_slot(str(path)) is old and len(cuda.registered) == 1  # kept, not re-pinned
    (before,) = cuda.registered
    os.truncate(path, 4 << 20)  # the agent grew it for a bigger state
    client.map_slot(str(path))

    assert cuda.unregistered == [before] and list(cuda.registered.values()) == [4 << 20]
    client.close()
    assert cuda.registered == {}


def test_slots_reserved_behind_a_save_are_pinned_from_the_saving_threads_gpu(
    cuda: FakeCudart,
    shm: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A thread starts on CUDA device 0: the rank's thread driving GPU 3 must hand its device
    # to the thread that reserves (and pins) the next saves' slots, or that thread opens a
    # context on GPU 0, which another rank uses.
    import threading

    from ckpt import Checkpointer

    current = threading.local()
    on_device: dict[int, int] = {}
    register = cuda.cudaHostRegister

    def registered_on_current(address: int, nbytes: int, flags: int) -> int:
        on_device[address] = getattr(current, "device", 0)
        return register(address, nbytes, flags)

    monkeypatch.setattr(cuda, "cudaHostRegister", registered_on_current)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "device", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(current, "device", int(d)))
    torch.cuda.set_device(3)  # the rank's GPU, set on its training thread
    c = Checkpointer(dir=shm / "c", tiers=[], ram_dir=shm, ram_namespace="phalanx-j-pin")
    try:
        assert c.save(1, {"w": torch.zeros(1 << 18)})  # allocates (pins) one slot ...
        c.close()  # ... and the other behind it; close waits for that
        assert len(on_device) == 2 and set(on_device.values()) == {3}
    finally:
        c.ram.unlink()
