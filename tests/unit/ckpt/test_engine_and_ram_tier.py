"""Engine and RAM-tier behaviours found in review (no fleet needed)."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

import ckpt.ram
from ckpt import DiskTier, Engine, RamTier, ShardKey, Tier, TierError, TierManifest
from ckpt.format import plan, write_into


class _AgentModeCatalog:
    """In agent mode a landing only reports; the commit comes later from the supervisor."""

    def landed(self, *args: Any) -> None:
        return None


class _Unreachable(Tier):
    name = "object"
    compresses = False

    def put(self, key: ShardKey, shard: Any, checksum: str) -> str:
        raise TierError("unreachable", tier="object")

    def steps(self, job: str) -> list[int]:
        return []

    def landed_steps(self, job: str) -> list[int]:
        return []

    def open(self, key: ShardKey) -> None:
        return None

    def delete(self, job: str, step: int) -> None:
        return None


def _save(ram: RamTier, engine: Engine, step: int, nbytes: int = 8) -> None:
    key = ShardKey("j", step, 0)
    shard = plan({"a": b"x" * nbytes}, ref=key.ref())
    slot = ram.acquire(key, shard.nbytes, when_busy="wait", timeout=5)
    write_into(shard, slot.view(shard.nbytes))
    engine.submit(slot, key)
    deadline = time.monotonic() + 10
    while not engine.idle() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_commit_of_the_oldest_sealed_step_keeps_it_in_ram(tmp_path: Path) -> None:
    ram = RamTier("phalanx-j-r0", job="j", directory=tmp_path, slots=3, keep=2, pin=False)
    engine = Engine(ram, [], keep={"ram": 2}, catalog=_AgentModeCatalog())  # type: ignore[arg-type]
    try:
        for step in (10, 20, 30):  # this rank is ahead; the gang has only committed 10
            _save(ram, engine, step)

        engine.commit("ram", TierManifest("j", 10, {0: ("x", 1)}), 0)

        assert 10 in ram.steps("j")
    finally:
        engine.close(5.0)
        ram.close()


def test_a_save_reuses_an_uncommitted_slot_when_commits_stop_coming(tmp_path: Path) -> None:
    # A broker crash lost the landings of 20 and 30: no catalog will ever commit them,
    # and every slot is protected (10 committed, 20 and 30 the newest). The save of 40
    # waits commit_wait_s, then takes 20's slot, not its whole timeout.
    ram = RamTier(
        "phalanx-j-r0", job="j", directory=tmp_path, slots=3, keep=2, pin=False, commit_wait_s=0.2
    )
    engine = Engine(ram, [], keep={"ram": 2}, catalog=_AgentModeCatalog())  # type: ignore[arg-type]
    try:
        _save(ram, engine, 10)
        engine.commit("ram", TierManifest("j", 10, {0: ("x", 1)}), 0)
        _save(ram, engine, 20)
        _save(ram, engine, 30)
        assert ram.acquire(ShardKey("j", 40, 0), 8, when_busy="skip", timeout=0) is None

        _save(ram, engine, 40)

        assert sorted(ram.steps("j")) == [10, 30, 40]  # the committed copy stays
    finally:
        engine.close(5.0)
        ram.close()


def test_a_slot_grows_after_a_tier_failure(tmp_path: Path) -> None:
    ram = RamTier("phalanx-j-r0", job="j", directory=tmp_path, slots=2, keep=1, pin=False)
    engine = Engine(ram, [_Unreachable()], keep={"ram": 1, "object": 1})
    try:
        _save(ram, engine, 1)
        _save(ram, engine, 2)

        _save(ram, engine, 3, nbytes=5 << 20)  # a bigger state: the slot must be remapped

        assert 3 in ram.steps("j")
    finally:
        engine.close(5.0)
        ram.close()


def test_failures_forgotten_for_a_new_generation_are_not_raised_by_its_wait(
    tmp_path: Path,
) -> None:
    ram = RamTier("phalanx-j-r0", job="j", directory=tmp_path, slots=2, keep=1, pin=False)
    engine = Engine(ram, [_Unreachable()], keep={"ram": 1, "object": 1})
    try:
        _save(ram, engine, 1)  # the older generation's write-down fails; nobody waits

        (dropped,) = engine.forget_failures()

        assert dropped.tier == "object"
        engine.wait(5.0)  # the new generation's wait does not raise the old failure
    finally:
        engine.close(5.0)
        ram.close()


def _agent_engine_with_disk(tmp_path: Path, keep: int) -> tuple[RamTier, DiskTier, Engine]:
    (tmp_path / "shm").mkdir()
    ram = RamTier("phalanx-j-r0", job="j", directory=tmp_path / "shm", slots=2, keep=1, pin=False)
    disk = DiskTier(tmp_path / "disk", name="nvme")
    engine = Engine(ram, [disk], keep={"ram": 1, "nvme": keep}, catalog=_AgentModeCatalog())  # type: ignore[arg-type]
    for step in (10, 20, 30):
        _save(ram, engine, step)
    assert disk.landed_steps("j") == [10, 20, 30]
    return ram, disk, engine


def _manifest(step: int) -> TierManifest:
    return TierManifest("j", step, {0: ("x", 1)})


def test_retention_counts_steps_the_fleet_committed_that_have_no_manifest_here(
    tmp_path: Path,
) -> None:
    ram, disk, engine = _agent_engine_with_disk(tmp_path, keep=2)
    try:
        # The fleet committed 10 and 20 at nvme; 10's manifest was never written here
        # (it landed before an agent restart). keep=2: both stay.
        engine.commit("nvme", _manifest(20), 0, fleet_committed={10, 20})
        assert disk.landed_steps("j") == [10, 20, 30]

        engine.commit("nvme", _manifest(30), 0, fleet_committed={10, 20, 30})
        assert disk.landed_steps("j") == [20, 30]
    finally:
        engine.close(5.0)
        ram.close()


def test_without_the_fleets_view_retention_would_take_a_committed_step(tmp_path: Path) -> None:
    ram, disk, engine = _agent_engine_with_disk(tmp_path, keep=2)
    try:
        engine.commit("nvme", _manifest(20), 0)  # only what this tier's manifests say

        assert disk.landed_steps("j") == [20, 30]  # 10 went: why the agent passes the fleet's
    finally:
        engine.close(5.0)
        ram.close()


def test_the_step_the_gang_restores_from_is_never_deleted(tmp_path: Path) -> None:
    ram, disk, engine = _agent_engine_with_disk(tmp_path, keep=1)
    try:
        engine.commit("nvme", _manifest(30), 0, fleet_committed={10, 20, 30}, protect={10})

        assert disk.landed_steps("j") == [10, 30]
    finally:
        engine.close(5.0)
        ram.close()


def test_a_step_committed_here_stays_until_the_fleets_newer_step_is_committed_here(
    tmp_path: Path,
) -> None:
    ram, disk, engine = _agent_engine_with_disk(tmp_path, keep=1)
    try:
        # One catalog commits 20 and 30 at nvme; this node writes 20's manifest first.
        engine.commit("nvme", _manifest(20), 0, fleet_committed={20, 30})
        assert disk.landed_steps("j") == [20, 30]  # 10 went; 20 stays until 30 is readable

        engine.commit("nvme", _manifest(30), 0, fleet_committed={20, 30})
        assert disk.landed_steps("j") == [30]
    finally:
        engine.close(5.0)
        ram.close()


def test_a_ram_tier_on_a_disk_filesystem_says_it_is_not_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ckpt.ram, "filesystem_type", lambda path: "ext4")
    monkeypatch.setattr(ckpt.ram, "_warned_dirs", set())

    with caplog.at_level(logging.WARNING, logger="ckpt.ram"):
        RamTier("phalanx-j-r0", job="j", directory=tmp_path, pin=False).close()
        RamTier("phalanx-j-r1", job="j", directory=tmp_path, pin=False).close()

    warned = [r.getMessage() for r in caplog.records if "not in memory" in r.getMessage()]
    assert len(warned) == 1  # once per folder, not once per rank
    assert str(tmp_path.resolve()) in warned[0] and "ext4" in warned[0]


def test_a_ram_tier_in_a_tmpfs_says_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ckpt.ram, "_warned_dirs", set())
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        assert ckpt.ram.filesystem_type(Path(shm)) == "tmpfs"

        with caplog.at_level(logging.WARNING, logger="ckpt.ram"):
            RamTier("phalanx-j-r0", job="j", directory=shm, pin=False).close()

    assert "not in memory" not in caplog.text


def test_slots_whose_files_were_removed_get_new_ones_before_a_rank_maps_them() -> None:
    # A /dev/shm cleaner (systemd's RemoveIPC, an operator) removed the segment files under
    # a live owner: a rank maps a slot by its path, so handing the old one out would fail.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        ram = RamTier("phalanx-j-r0", job="j", directory=shm, slots=2, keep=1, pin=False)
        ram.reserve(1 << 20)
        for segment in Path(shm).iterdir():
            segment.unlink()

        ram.reserve(1 << 20)
        assert sorted(p.name for p in Path(shm).iterdir()) == [
            "phalanx-j-r0.slot0",
            "phalanx-j-r0.slot1",
        ]
        Path(shm, "phalanx-j-r0.slot0").unlink()
        slot = ram.acquire(ShardKey("j", 1, 0), 4096, when_busy="skip", timeout=1)
        assert slot is not None and slot.path.exists()
        ram.unlink()


def test_a_size_no_slot_can_hold_is_refused_and_leaves_every_slot_free(tmp_path: Path) -> None:
    ram = RamTier("phalanx-j-r0", job="j", directory=tmp_path, slots=2, keep=1, pin=False)
    try:
        for nbytes in (-1, 2**63):
            with pytest.raises(ValueError, match="cannot have a RAM-tier slot"):
                ram.acquire(ShardKey("j", 1, 0), nbytes, when_busy="skip", timeout=1)
        with pytest.raises(ValueError, match="cannot reserve"):
            ram.reserve(-5)

        assert not any(s is not None and s.busy for s in ram.slots)
        assert ram.acquire(ShardKey("j", 1, 0), 100, when_busy="skip", timeout=1) is not None
    finally:
        ram.unlink()


@pytest.mark.parametrize(("step", "rank"), [(-1, 0), (10**12, 0), (0, 10**5), (1.5, 0)])
def test_a_step_or_rank_no_file_can_be_named_by_is_refused(step: Any, rank: int) -> None:
    with pytest.raises(ValueError, match=r"(step|rank) .* must be an integer"):
        ShardKey("j", step, rank)


def test_a_staged_copy_is_never_kept_from_the_next_save() -> None:
    # A rank that restored an older step S from below while its RAM holds a newer T (the
    # newest committed there): the slot S was staged in must go to the rank's first save.
    from ckpt.format import encode

    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        ram = RamTier("phalanx-j-r0", job="j", directory=shm, slots=2, keep=1, pin=False)
        engine = Engine(ram, [], keep={"ram": 1}, catalog=_AgentModeCatalog())  # type: ignore[arg-type]
        try:
            _save(ram, engine, 20)
            engine.commit("ram", TierManifest("j", 20, {0: ("x", 1)}), 0)
            older = encode({"w": b"s" * 64}, ref=ShardKey("j", 10, 0).ref())

            def fill(view: memoryview) -> None:
                view[:] = older

            assert ram.stage(ShardKey("j", 10, 0), len(older), fill) is not None

            slot = ram.acquire(ShardKey("j", 11, 0), 64, when_busy="skip", timeout=1)
            assert slot is not None and slot.step == 11  # the staged slot, T kept
            assert ram.steps("j") == [20]
        finally:
            engine.close(5.0)
            ram.unlink()


def test_a_slot_being_allocated_holds_up_no_reader_and_no_save_into_another_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Fresh memory takes seconds per GiB: an agent's event loop listing the tier's steps, or
    # the rank's save into the other slot, must not wait for a slot reserved behind a restore.
    import threading

    real = RamTier._allocate
    inside, gate = threading.Event(), threading.Event()

    def slow(self: RamTier, index: int, capacity: int) -> ckpt.ram.Slot:
        if index == 1:
            inside.set()
            assert gate.wait(30)
        return real(self, index, capacity)

    monkeypatch.setattr(RamTier, "_allocate", slow)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        ram = RamTier("phalanx-j-r0", job="j", directory=shm, slots=2, keep=1, pin=False)
        reserving = threading.Thread(target=ram.reserve, args=(1 << 20,))
        try:
            first = ram.acquire(ShardKey("j", 1, 0), 4096, when_busy="skip", timeout=1)
            assert first is not None and first.index == 0
            ram.release(first, keep_content=False)
            reserving.start()
            assert inside.wait(30)  # slot 1 is being allocated

            done: list[object] = []
            other = threading.Thread(
                target=lambda: done.extend(
                    [
                        ram.steps("j"),
                        ram.acquire(ShardKey("j", 2, 0), 4096, when_busy="wait", timeout=30),
                    ]
                )
            )
            other.start()
            other.join(10)
            assert not other.is_alive() and done[0] == []  # never waited for slot 1
            slot = done[1]
            assert isinstance(slot, ckpt.ram.Slot) and slot.index == 0
            # Slot 0 busy, slot 1 still being allocated: "skip" waits for slot 1, as it
            # would have for its own allocation, rather than skip the save.
            skipping = threading.Thread(
                target=lambda: done.append(
                    ram.acquire(ShardKey("j", 3, 0), 4096, when_busy="skip", timeout=30)
                )
            )
            skipping.start()
            skipping.join(0.5)
            assert skipping.is_alive()  # waiting, not skipped
            gate.set()
            skipping.join(30)
            third = done[2]
            assert isinstance(third, ckpt.ram.Slot) and third.index == 1
            ram.release(third, keep_content=False)
            ram.release(slot, keep_content=False)
        finally:
            gate.set()
            if reserving.is_alive():
                reserving.join(30)
            assert all(s is not None and s.capacity >= 1 << 20 for s in ram.slots)
            ram.unlink()
