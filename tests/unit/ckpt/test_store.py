"""The tiered store, standalone: real shared memory, real files, real faults."""

from __future__ import annotations

import errno
import os
import pickle
import random
import signal
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

import ckpt.files
from ckpt import Checkpointer, DiskTier, TierError, TierEvent, UnsafeShard
from ckpt.tiers import MANIFEST_NAME, step_dir
from tests.unit.ckpt.helpers import (
    GatedTier,
    assert_bit_identical,
    open_ckpt,
    small_tmpfs,
    training_state,
)

REPO = Path(__file__).resolve().parents[3]


def disk_shard(root: Path, step: int) -> Path:
    return root / "disk" / "local" / step_dir(step) / "rank-00000.phx"


def test_save_then_restore_is_bit_exact_with_optimizer_scheduler_rngs_and_loader(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    state = training_state()
    c = open_ckpt(ckpts, tmp_path)
    assert c.save(2, state)
    c.wait()
    found = open_ckpt(ckpts, tmp_path).restore()
    assert found is not None
    step, restored = found
    assert step == 2
    assert_bit_identical(state, restored)
    torch.set_rng_state(restored["rng"]["torch"])
    np.random.set_state(restored["rng"]["numpy"])
    random.setstate(restored["rng"]["python"])
    draws = (torch.rand(3), np.random.rand(3), random.random())
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    assert_bit_identical(draws, (torch.rand(3), np.random.rand(3), random.random()))


def test_restore_comes_from_ram_while_the_ram_copy_exists(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    c = open_ckpt(ckpts, tmp_path)
    c.save(5, {"w": torch.arange(10.0)})
    c.wait()
    found = c.restore()
    assert found is not None and found[0] == 5 and c.restored_from == "ram"


def test_restore_uses_disk_after_the_ram_copy_is_gone(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    state = {"w": torch.randn(1000)}
    c = open_ckpt(ckpts, tmp_path)
    c.save(1, state)
    c.close()  # the step is durable on disk, so the RAM segments are released
    fresh = open_ckpt(ckpts, tmp_path)
    found = fresh.restore()
    assert found is not None and fresh.restored_from == "disk"
    assert_bit_identical(state, found[1])


def test_a_restore_allocates_the_ram_slots_for_the_next_saves_behind_it(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    state = {"w": torch.randn(1 << 18)}  # 1 MiB
    c = open_ckpt(ckpts, tmp_path)
    c.save(1, state)
    c.close()  # committed on disk: the RAM slots go
    fresh = open_ckpt(ckpts, tmp_path)
    assert not [s for s in fresh.ram.slots if s is not None]

    found = fresh.restore()

    assert found is not None and fresh.restored_from == "disk"
    deadline = time.monotonic() + 30
    while not all(s is not None and s.capacity >= 1 << 20 for s in fresh.ram.slots):
        assert time.monotonic() < deadline, "the slots were never allocated"
        time.sleep(0.02)
    assert fresh.save(2, found[1]) and fresh.save(3, found[1])
    fresh.wait()
    assert fresh.restore() is not None and fresh.restored_from == "ram"


def test_a_first_save_allocates_the_slots_of_the_saves_after_it_behind_it(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    c = open_ckpt(ckpts, tmp_path)  # no reserve(): the first save allocates its slot
    assert c.save(1, {"w": torch.randn(1 << 18)})  # 1 MiB

    deadline = time.monotonic() + 30
    while not all(s is not None and s.capacity >= 1 << 20 for s in c.ram.slots):
        assert time.monotonic() < deadline, "the other slots were never allocated"
        time.sleep(0.02)
    c.wait()


def test_restore_uses_the_object_store_after_disk_is_gone(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    state = {"w": torch.randn(1000), "step": 9}
    c = open_ckpt(ckpts, tmp_path, object_store=str(tmp_path / "bucket"))
    c.save(9, state)
    c.close()
    for path in (tmp_path / "disk").rglob("*.phx"):
        path.unlink()
    fresh = open_ckpt(ckpts, tmp_path, object_store=str(tmp_path / "bucket"))
    found = fresh.restore()
    assert found is not None and found[0] == 9 and fresh.restored_from == "object"
    assert_bit_identical(state, found[1])


def restore_after_changing_the_disk_copy(
    tmp_path: Path,
    ckpts: list[Checkpointer],
    change: Callable[[bytearray], None],
) -> list[TierEvent]:
    """Save step 3 to disk and an object store, ``change`` the disk copy's bytes, restore
    anew: it must come from the object store, bit for bit. The events it reported."""
    state = {"w": torch.randn(1000)}
    c = open_ckpt(ckpts, tmp_path, object_store=str(tmp_path / "bucket"))
    c.save(3, state)
    c.close()
    shard = disk_shard(tmp_path, 3)
    data = bytearray(shard.read_bytes())
    change(data)
    shard.write_bytes(data)
    events: list[TierEvent] = []
    fresh = open_ckpt(
        ckpts, tmp_path, object_store=str(tmp_path / "bucket"), on_event=events.append
    )
    found = fresh.restore()
    assert found is not None and fresh.restored_from == "object"
    assert_bit_identical(state, found[1])
    return [e for e in events if e.tier == "disk"]


def test_a_flipped_byte_on_disk_is_detected_and_the_next_tier_is_used(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    def flip(data: bytearray) -> None:
        data[len(data) // 2] ^= 0x01

    (corrupt,) = restore_after_changing_the_disk_copy(tmp_path, ckpts, flip)

    assert corrupt.kind == "corrupt" and corrupt.path == str(disk_shard(tmp_path, 3))


def test_a_shard_of_a_newer_format_version_falls_through_without_a_corrupt_report(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    def newer(data: bytearray) -> None:  # as a newer writer would, mid rolling upgrade
        data[8:12] = (99).to_bytes(4, "little")

    (failed,) = restore_after_changing_the_disk_copy(tmp_path, ckpts, newer)

    assert failed.kind == "failed" and "version 99 is not supported" in (failed.error or "")


def test_a_shard_crafted_to_execute_code_on_load_does_not_run(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    c = open_ckpt(ckpts, tmp_path)
    c.save(4, {"w": torch.zeros(4)})
    c.close()
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    shard = disk_shard(tmp_path, 4)
    shard.write_bytes(pickle.dumps({"w": Exploit()}))
    (shard.parent / MANIFEST_NAME).write_text((shard.parent / MANIFEST_NAME).read_text())
    events: list[TierEvent] = []
    fresh = open_ckpt(ckpts, tmp_path, on_event=events.append)
    assert fresh.restore() is None
    with pytest.raises(UnsafeShard):
        fresh.restore(4)
    assert not marker.exists()
    assert any(e.kind == "corrupt" and "pickle" in (e.error or "") for e in events)


def test_a_torch_save_file_in_place_of_a_shard_is_refused(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    c = open_ckpt(ckpts, tmp_path)
    c.save(4, {"w": torch.zeros(4)})
    c.close()
    torch.save({"w": torch.ones(4)}, disk_shard(tmp_path, 4))
    with pytest.raises(UnsafeShard):
        open_ckpt(ckpts, tmp_path).restore(4)


def fail_writes_with_enospc(monkeypatch: pytest.MonkeyPatch, after_bytes: int) -> None:
    """Fault injection at the write boundary: the disk 'fills' after some bytes."""
    real_write = os.write
    written = [0]

    def write(fd: int, data: Any) -> int:
        if written[0] + len(data) > after_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        return real_write(fd, data)

    monkeypatch.setattr(ckpt.files.os, "write", write)


def test_a_full_disk_keeps_the_last_committed_step_and_names_tier_and_path(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = open_ckpt(ckpts, tmp_path, keep=1)
    c.save(1, {"w": torch.ones(1000)})
    c.wait()
    fail_writes_with_enospc(monkeypatch, after_bytes=1000)
    c.save(2, {"w": torch.full((1000,), 2.0)})
    with pytest.raises(TierError) as caught:
        c.wait()
    assert caught.value.tier == "disk"
    assert caught.value.path is not None and "000000000002" in caught.value.path
    assert "disk is full" in str(caught.value)
    disk = c.tiers[0]
    assert disk.steps("local") == [1]
    assert not list((tmp_path / "disk").rglob("*.tmp-*"))
    monkeypatch.undo()
    c.close()
    found = open_ckpt(ckpts, tmp_path).restore(1)
    assert found is not None and torch.equal(found[1]["w"], torch.ones(1000))


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs, where mounting is permitted (root in a container)."""
    with small_tmpfs(tmp_path / "small") as mnt:
        yield mnt


def test_a_really_full_filesystem_keeps_the_committed_step_and_reports_enospc(
    small_fs: Path, ckpts: list[Checkpointer]
) -> None:
    c = open_ckpt(ckpts, small_fs, keep=1)
    c.save(1, {"w": torch.ones(256 << 10)})  # 1 MiB
    c.wait()
    c.save(2, {"w": torch.ones(3 << 20)})  # 12 MiB: cannot fit
    with pytest.raises(TierError, match="disk is full") as caught:
        c.wait()
    assert caught.value.tier == "disk" and str(small_fs) in (caught.value.path or "")
    assert c.tiers[0].steps("local") == [1]
    c.ram.unlink()  # step 2 only in RAM: make restore read the disk
    found = open_ckpt(ckpts, small_fs).restore()
    assert found is not None and found[0] == 1
    assert torch.equal(found[1]["w"], torch.ones(256 << 10))


def test_retention_keeps_the_previous_committed_step_until_a_newer_one_commits(
    tmp_path: Path, ckpts: list[Checkpointer], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = open_ckpt(ckpts, tmp_path, keep=1)
    disk = c.tiers[0]
    c.save(1, {"w": torch.ones(100)})
    c.wait()
    fail_writes_with_enospc(monkeypatch, after_bytes=0)
    c.save(2, {"w": torch.ones(100)})
    with pytest.raises(TierError):
        c.wait()
    assert disk.steps("local") == [1]
    monkeypatch.undo()
    c.save(3, {"w": torch.ones(100)})
    c.wait()
    assert disk.steps("local") == [3]
    deleted = [e for e in c.events if e.kind == "deleted" and e.tier == "disk"]
    committed_before = {
        e.key.step
        for e in c.events
        if e.kind == "committed" and e.tier == "disk" and e.at <= deleted[0].at
    }
    assert 1 in [e.key.step for e in deleted] and 3 in committed_before


def test_keep_two_keeps_the_two_newest_committed_steps(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    c = open_ckpt(ckpts, tmp_path, keep={"disk": 2})
    for step in range(1, 6):
        c.save(step, {"w": torch.full((10,), float(step))})
    c.wait()
    assert c.tiers[0].steps("local") == [4, 5]


def test_when_busy_skip_skips_the_save_and_reports_it(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    gated = GatedTier()
    c = open_ckpt(ckpts, tmp_path, tiers=[gated], when_busy="skip")
    assert c.save(1, {"w": torch.ones(10)})  # slot A: held by the gated write-down
    assert gated.entered.wait(10)
    assert c.save(2, {"w": torch.ones(10)})  # slot B: newest RAM copy, protected
    assert not c.save(3, {"w": torch.ones(10)})
    assert c.skipped == [3]
    assert [e.key.step for e in c.events if e.kind == "skipped"] == [3]
    gated.gate.set()
    c.wait()
    assert sorted(gated.landed) == [1, 2]


def test_when_busy_wait_waits_for_the_write_down_to_free_a_slot(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    gated = GatedTier()
    c = open_ckpt(ckpts, tmp_path, tiers=[gated], when_busy="wait", keep=10)
    c.save(1, {"w": torch.ones(10)})
    assert gated.entered.wait(10)
    c.save(2, {"w": torch.ones(10)})
    third = threading.Thread(target=c.save, args=(3, {"w": torch.ones(10)}))
    third.start()
    third.join(0.5)
    assert third.is_alive()  # waiting, not overwriting
    gated.gate.set()
    third.join(10)
    assert not third.is_alive()
    c.wait()
    assert sorted(gated.landed) == [1, 2, 3] and c.skipped == []


def test_a_new_save_never_overwrites_a_buffer_still_being_written_down(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    gated = GatedTier()
    c = open_ckpt(ckpts, tmp_path, tiers=[gated], ram_slots=3, when_busy="wait", keep=10)
    savers = []
    for step in range(1, 7):
        t = threading.Thread(target=c.save, args=(step, {"w": torch.full((4096,), float(step))}))
        t.start()
        savers.append(t)
        if step == 1:
            assert gated.entered.wait(10)
        time.sleep(0.05)
    gated.gate.set()
    for t in savers:
        t.join(10)
    c.wait()
    assert gated.bad == [] and sorted(gated.landed) == list(range(1, 7))
    for step, data in gated.landed.items():
        from ckpt import decode

        assert torch.equal(decode(bytearray(data))["w"], torch.full((4096,), float(step)))


def test_the_ram_segment_survives_sigkill_of_the_saving_process(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, time, torch
        from ckpt import Checkpointer
        c = Checkpointer(dir={str(tmp_path)!r}, tiers=[])
        c.save(7, {{"w": torch.arange(1000.0), "step": 7}})
        c.wait()
        print("saved", c.ram.namespace, flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("saved"), line
        namespace = line.split()[1]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    assert list(Path("/dev/shm").glob(f"{namespace}.slot*"))
    fresh = Checkpointer(dir=tmp_path, tiers=[])
    try:
        found = fresh.restore()
        assert found is not None and found[0] == 7 and fresh.restored_from == "ram"
        assert torch.equal(found[1]["w"], torch.arange(1000.0))
    finally:
        fresh.close()
        fresh.ram.unlink()


def test_disk_rescan_removes_writes_that_never_finished(tmp_path: Path) -> None:
    stale = tmp_path / "job" / step_dir(3) / ".rank-00000.phx.tmp-123-0"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a shard")
    tier = DiskTier(tmp_path)
    assert not stale.exists() and tier.steps("job") == []


def test_due_every_n_steps(tmp_path: Path, ckpts: list[Checkpointer]) -> None:
    c = open_ckpt(ckpts, tmp_path, interval=5)
    assert [s for s in range(1, 16) if c.due(s)] == [5, 10, 15]


def test_due_auto_uses_the_young_daly_interval_from_the_measured_stall(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    c = open_ckpt(ckpts, tmp_path, interval="auto", mtbf_s=3600.0)
    assert c.due(1)
    c.save(1, {"w": torch.ones(10)})
    stall = c.stalls[0]
    assert c.policy.seconds() == pytest.approx((2 * stall * 3600.0) ** 0.5)
    assert not c.due(2)
    c.policy.last_time -= (2 * stall * 3600.0) ** 0.5 + 1
    assert c.due(2)


def test_auto_interval_without_mtbf_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mtbf_s"):
        Checkpointer(dir=tmp_path, interval="auto")
