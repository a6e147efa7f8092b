"""The checkpoint package's exception family: every error ``ckpt`` raises is a
``CheckpointError``, and the object stores' errors stay ``OSError``s too."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

import ckpt
from ckpt import (
    AgentError,
    CheckpointError,
    LocalFolderStore,
    ObjectTier,
    ObjectTooLarge,
    PeerError,
    ShardGone,
    ShardRef,
    TierError,
)


@pytest.mark.parametrize("name", ["ShardGone", "AgentError", "PeerError", "ObjectTooLarge"])
def test_the_error_is_a_checkpoint_error_importable_from_ckpt(name: str) -> None:
    error = getattr(ckpt, name)

    assert issubclass(error, CheckpointError)
    assert error.__module__ == "ckpt.errors"


@pytest.mark.parametrize("error", [PeerError, ObjectTooLarge])
def test_an_object_stores_error_is_still_an_os_error(error: type[Exception]) -> None:
    assert issubclass(error, OSError)


def test_object_too_large_names_the_object_and_keeps_its_limit_across_processes() -> None:
    error = ObjectTooLarge("a body of 10 bytes", 4, " (decompressed)")

    copy = pickle.loads(pickle.dumps(error))

    assert str(copy) == "a body of 10 bytes is larger than the 4-byte limit (decompressed)"
    assert (copy.what, copy.limit) == ("a body of 10 bytes", 4)


def test_an_agent_error_keeps_its_status_and_ids_across_processes() -> None:
    error = AgentError("refused", ref=ShardRef(job="job-1", rank=3), status=409)

    copy = pickle.loads(pickle.dumps(error))

    assert (copy.status, copy.job, copy.rank) == (409, "job-1", 3)
    assert str(copy) == str(error) == "refused (job=job-1 rank=3)"


def test_a_shard_gone_carries_the_ids_in_its_message() -> None:
    error = ShardGone("the copy is gone", ref=ShardRef(job="job-1", step=7, path="/x"))

    assert str(error) == "the copy is gone (job=job-1 step=7 path=/x)"


class FailingPeer(LocalFolderStore):
    """A buddy that answers every read with an error."""

    def get(self, key: str, *, max_nbytes: int = 1 << 20) -> bytes:
        raise PeerError(f"GET {key}: peer n02 answered 500: disk on fire")


def test_a_manifest_the_store_cannot_read_is_a_tier_error_not_a_missing_one(
    tmp_path: Path,
) -> None:
    """A store's error is a ``CheckpointError`` now; reading a manifest must still tell a
    failing store (``TierError``) from a manifest that is not one (``None``)."""
    tier = ObjectTier(FailingPeer(tmp_path), name="peer")

    with pytest.raises(TierError, match="disk on fire"):
        tier.manifest("job-1", 3)


def test_resharding_reads_outside_phalanx_say_they_need_its_agent(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    with ckpt.Checkpointer(tmp_path / "c", ram_dir=tmp_path / "shm") as c:
        for call in (c.saved_layout, lambda: c.restore_shards([0])):
            with pytest.raises(ckpt.CheckpointError, match="works under Phalanx only"):
                call()
