"""``phalanx.http.loads``, how every HTTP body of the daemons is parsed: nesting is
bounded without recursion, and any bytes give a value or a ``ValueError``, nothing else."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.http import MAX_JSON_DEPTH, loads


def test_json_nested_to_the_depth_limit_parses() -> None:
    assert loads("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 2, 100_000])
def test_json_nested_past_the_depth_limit_is_a_value_error(depth: int) -> None:
    with pytest.raises(ValueError, match="recursion limit exceeded"):
        loads("[" * depth + "]" * depth)


@settings(max_examples=500, derandomize=True, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_parse_or_are_a_value_error(data: bytes) -> None:
    with contextlib.suppress(ValueError):
        loads(data)
