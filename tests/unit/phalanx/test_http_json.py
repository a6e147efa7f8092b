"""``phalanx.http.loads``, how every HTTP body of the daemons is parsed: nesting is
bounded without recursion, and any bytes give a value or a ``ValueError``, nothing else."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.http import MAX_JSON_DEPTH, dumps, loads


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


def _no_constants(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")


def test_a_body_is_strict_json_with_non_finite_numbers_as_null_also_past_64_bit_ints() -> None:
    for data in (
        {"ratio": float("inf"), "loss": float("nan"), "step": 3},
        {"ratio": float("inf"), "big": 2**70},  # orjson refuses the int: json writes it
    ):
        body = dumps(data)
        parsed = json.loads(body, parse_constant=_no_constants)
        assert parsed == {k: (None if isinstance(v, float) else v) for k, v in data.items()}
