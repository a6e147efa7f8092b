"""The sweep after a pytest session that ran the rig: what a run whose owner is gone left
is removed (a pytest-xdist worker its controller killed before it had torn its fleet
down, after a Ctrl-C; a run that crashed), never a live run's (``fleet.down_all``).

Registered by ``tests/conftest.py``, the conftest every session loads (a parallel run's
controller collects nothing, so it never loads ``tests/rig/``'s own modules by itself).
"""

from __future__ import annotations

import os

import pytest

RIG_TESTS = "tests/rig/test_rig.py::"


class RigSweep:
    """A plugin: it notes whether a rig scenario ran (the controller sees every worker's
    reports) and, once the session is over and its workers gone, sweeps."""

    def __init__(self) -> None:
        self.ran = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid.startswith(RIG_TESTS):
            self.ran = True

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        # A worker leaves it to its controller, which sweeps after they are all gone.
        if hasattr(config, "workerinput") or not self.ran or os.geteuid() != 0:
            return
        from tests.rig.fleet import down_all

        swept = down_all(everything=False)
        if swept["removed"]:
            print(f"\nrig: removed what runs whose owner is gone left: {swept['removed']}")
