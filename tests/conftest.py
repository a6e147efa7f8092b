from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Broker, Fleet


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()


@pytest.fixture
def fleet(tmp_path: Path, broker: Broker, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    f = Fleet(tmp_path, broker)
    yield f
    f.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:  # show the daemons' logs with the failure
        ranks = sorted((tmp_path / "nodes").glob("*/data/jobs/*/g*/rank-*.log"))
        for log in [*sorted((tmp_path / "logs").glob("*.log")), *ranks]:
            name = log.relative_to(tmp_path)
            sys.stderr.write(f"\n----- {name} -----\n{log.read_text(errors='replace')[-4000:]}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep
