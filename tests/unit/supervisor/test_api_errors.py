"""The REST API answers each of the supervisor's errors with its own HTTP status."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.api.app import http_status
from supervisor.errors import (
    CommandTimeout,
    IllegalTransition,
    Refused,
    RegistryError,
    StoreCorrupt,
    StoreError,
    UnknownJob,
    UnknownNode,
)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (UnknownNode("ghost"), 404),
        (UnknownJob("j-1"), 404),
        (Refused("node 'n1' is not drained"), 409),
        (RegistryError("a drain needs a reason"), 400),
        (CommandTimeout("n1", "ping", "c0ffee", 10.0), 504),
        (StoreError(Path("state.db"), "cannot write the supervisor store: disk full"), 503),
        (StoreCorrupt(Path("state.db"), "database disk image is malformed", None), 503),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_a_request_error_answers_its_http_status(error: Exception, status: int) -> None:
    assert http_status(error) == status


def test_an_error_of_the_supervisor_itself_is_no_request_error() -> None:
    assert http_status(IllegalTransition("j-1", "succeeded", "running")) is None
    assert http_status(KeyError("rank")) is None
