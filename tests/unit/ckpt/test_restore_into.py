"""``restore(into=...)``: a restore copies into the live state's tensors, standalone and
through a real agent, and never writes them from a copy that does not verify."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt import Checkpointer, FormatError, ShardCorrupt, decode, encode, seal
from ckpt.tiers import step_dir
from tests.unit.agentd.test_ckpt_agent_mode import AgentHarness
from tests.unit.ckpt.helpers import assert_bit_identical, open_ckpt, saved_ckpt, training_state


def live_state() -> dict[str, Any]:
    """The same structure as ``training_state()``, other values: a run that went on."""
    return training_state(seed=7)


def tensors_of(state: Any, where: str = "state") -> dict[str, Any]:
    """Every tensor and array in a state, by place."""
    found: dict[str, Any] = {}
    if isinstance(state, torch.Tensor | np.ndarray):
        found[where] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            found.update(tensors_of(v, f"{where}[{k!r}]"))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            found.update(tensors_of(v, f"{where}[{i}]"))
    return found


def assert_filled_in_place(restored: Any, live: Any, saved: Any) -> None:
    assert_bit_identical(restored, saved)
    before = tensors_of(live)
    after = tensors_of(restored)
    assert before.keys() == after.keys() and before
    for where, tensor in before.items():
        assert after[where] is tensor, where
    assert_bit_identical(live["model"], saved["model"])
    assert_bit_identical(live["optimizer"], saved["optimizer"])


def test_restore_from_ram_into_the_live_state_fills_its_tensors_bit_exact(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    saved = training_state()
    c = saved_ckpt(ckpts, tmp_path, 2, saved)
    live = live_state()
    pointers = {w: t.data_ptr() for w, t in tensors_of(live).items() if isinstance(t, torch.Tensor)}

    found = c.restore(into=live)

    assert found is not None and found[0] == 2 and c.restored_from == "ram"
    assert_filled_in_place(found[1], live, saved)
    assert {
        w: t.data_ptr() for w, t in tensors_of(found[1]).items() if isinstance(t, torch.Tensor)
    } == pointers
    assert c.restored_fresh == []


def test_restore_from_disk_into_the_live_state_fills_its_tensors(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    saved = training_state()
    c = open_ckpt(ckpts, tmp_path)
    c.save(2, saved)
    c.close()  # durable on disk: the RAM segments go
    live = live_state()
    reader = open_ckpt(ckpts, tmp_path)

    found = reader.restore(into=live)

    assert found is not None and reader.restored_from == "disk"
    assert_filled_in_place(found[1], live, saved)


def test_a_tensor_that_does_not_match_comes_back_new_and_is_named(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    saved = {
        "w": torch.randn(8),
        "b": torch.randn(4),
        "p": torch.nn.Parameter(torch.randn(3)),
        "i": torch.arange(5),
        "kept": torch.randn(2),
    }
    c = saved_ckpt(ckpts, tmp_path, 1, saved)
    live = {
        "w": torch.zeros(9),
        "b": torch.zeros(4, dtype=torch.float64),
        "p": torch.zeros(3),
        "kept": torch.zeros(2),
    }
    untouched = copy.deepcopy({k: v for k, v in live.items() if k != "kept"})

    found = c.restore(into=live)

    assert found is not None
    restored = found[1]
    assert_bit_identical(restored, saved)
    assert restored["kept"] is live["kept"]
    for name in ("w", "b", "p"):
        assert restored[name] is not live[name]
        assert_bit_identical(live[name], untouched[name])
    assert type(restored["p"]) is torch.nn.Parameter
    assert sorted(c.restored_fresh) == sorted(["tree['w']", "tree['b']", "tree['p']", "tree['i']"])


def test_a_parameter_is_restored_into_a_parameter_with_its_requires_grad(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    saved = {"p": torch.nn.Parameter(torch.randn(6), requires_grad=False)}
    c = saved_ckpt(ckpts, tmp_path, 1, saved)
    live = {"p": torch.nn.Parameter(torch.zeros(6))}

    found = c.restore(into=live)

    assert found is not None and found[1]["p"] is live["p"]
    assert not live["p"].requires_grad
    assert_bit_identical(found[1], saved)


def test_a_corrupt_ram_copy_is_skipped_and_never_written_into_the_live_state(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    saved = training_state()
    c = saved_ckpt(ckpts, tmp_path, 2, saved)
    slot = c.ram.find(2)
    assert slot is not None
    view = slot.view()
    view[len(view) // 2] ^= 0x10
    live = live_state()

    found = c.restore(into=live)

    assert found is not None and c.restored_from == "disk"
    assert_filled_in_place(found[1], live, saved)
    assert [e.tier for e in c.events if e.kind == "corrupt"] == ["ram"]


def test_a_shard_that_fails_to_decode_leaves_the_live_state_untouched() -> None:
    buffer = encode({"a": torch.randn(16), "z": torch.tensor([True, False])})
    # A bool byte of 2, sealed anew: the checksum passes, the decoder refuses the value.
    index = bytes(buffer).rindex(b"\x01\x00", 0, len(buffer) - 32)
    buffer[index] = 2
    seal(buffer)
    live = {"a": torch.zeros(16), "z": torch.zeros(2, dtype=torch.bool)}

    with pytest.raises(FormatError, match="bool tensor"):
        decode(buffer, into=live)

    assert torch.equal(live["a"], torch.zeros(16))


def test_a_shard_that_fails_its_checksum_leaves_the_live_state_untouched() -> None:
    buffer = encode({"a": torch.ones(16)})
    buffer[200] ^= 0xFF
    live = {"a": torch.zeros(16)}

    with pytest.raises(ShardCorrupt):
        decode(buffer, into=live)

    assert torch.equal(live["a"], torch.zeros(16))


def test_restore_into_through_the_agent_fills_the_live_tensors_from_ram_and_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ckpts: list[Checkpointer]
) -> None:
    (tmp_path / "shm").mkdir()
    agent = AgentHarness(tmp_path)
    try:
        for key, value in agent.env().items():
            monkeypatch.setenv(key, value)
        saved = training_state()
        c = Checkpointer()
        ckpts.append(c)
        c.save(4, saved)
        c.wait(timeout=60)

        live = live_state()
        reader = Checkpointer()
        ckpts.append(reader)
        found = reader.restore(into=live)
        assert found is not None and found[0] == 4 and reader.restored_from == "ram"
        assert_filled_in_place(found[1], live, saved)

        for segment in (tmp_path / "shm").iterdir():
            segment.unlink()
        assert (tmp_path / "data" / "ckpt" / "job-1" / step_dir(4)).is_dir()
        live = live_state()
        found = Checkpointer().restore(into=live)
        assert found is not None
        assert_filled_in_place(found[1], live, saved)
    finally:
        for c in ckpts:
            c.close()
        ckpts.clear()
        agent.close()
