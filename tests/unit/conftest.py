"""Fixtures the checkpoint store's unit tests share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from ckpt import Checkpointer


@pytest.fixture
def ckpts() -> Iterator[list[Checkpointer]]:
    """Checkpointers a test opens (``ckpt_helpers.open_ckpt``); each is closed and its RAM
    segments removed."""
    opened: list[Checkpointer] = []
    yield opened
    for c in opened:
        with contextlib.suppress(Exception):
            c.close(timeout=30)
        if c.agent is None:
            c.ram.unlink()
