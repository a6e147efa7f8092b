"""Fixtures of the link's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Broker


@pytest.fixture
def brokers(tmp_path: Path) -> Iterator[tuple[Broker, Broker]]:
    """Two Mosquitto brokers, each in a folder of its own, stopped after."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = Broker(tmp_path / "a").start()
    try:
        b = Broker(tmp_path / "b").start()
    except BaseException:
        a.stop()
        raise
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()
