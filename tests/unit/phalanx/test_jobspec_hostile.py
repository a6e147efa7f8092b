"""Hostile job specs: YAML bombs, deep nesting, huge numbers and values YAML cannot build
are each a ``JobSpecError`` naming the source (and the line where the YAML has one),
never another exception and never a hang; and, for any text at all, ``load_spec``
raises nothing but ``JobSpecError`` (a property checked by Hypothesis)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phalanx.jobspec import (
    MAX_SPEC_CHARS,
    MAX_SPEC_DEPTH,
    MAX_SPEC_NODES,
    JobSpecError,
    load_spec,
    validate_spec,
)

# Lines 1-6; a test appends its own fields from line 7 on.
BASE = """\
name: tinylm
team: research
command: [python, train.py]
workdir: /srv/tinylm
nodes: 2
ranks_per_node: 4
"""


def refused(text: str) -> list[tuple[str, int | None, str]]:
    with pytest.raises(JobSpecError) as caught:
        load_spec(text)
    return caught.value.errors


def laughs(levels: int) -> str:
    """Nine aliases to the level below at each level: 9**levels strings once expanded."""
    text = 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for i in range(1, levels):
        text += f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n"
    return text


@pytest.mark.timeout(10)
def test_a_billion_laughs_is_refused_at_the_node_limit_without_expanding() -> None:
    [(field, _, message)] = refused(laughs(10) + BASE)

    assert field == "job spec"
    assert message == f"more than {MAX_SPEC_NODES} values once its aliases expand"


@pytest.mark.timeout(10)
def test_a_billion_laughs_under_a_real_field_is_refused_too() -> None:
    text = laughs(10) + BASE.replace("command: [python, train.py]", "command: *l9")

    assert "aliases expand" in refused(text)[0][2]


def test_anchors_and_merge_keys_under_the_limits_still_load() -> None:
    spec = load_spec(
        "defaults: &env {OMP_NUM_THREADS: 4}\n".replace("defaults", "env")
        + BASE
        + "placement: &p {policy: spread}\nrestart: {<<: {max_restarts: 5}}\n"
    )

    assert spec.env == {"OMP_NUM_THREADS": "4"}
    assert spec.restart.max_restarts == 5


@pytest.mark.parametrize(
    "nesting",
    [
        "[" * 5000 + "]" * 5000,
        "{a: " * 5000 + "1" + "}" * 5000,
        "".join(f"\n{'  ' * i}- " for i in range(200)) + "x",
    ],
    ids=["flow sequences", "flow mappings", "block sequences"],
)
def test_nesting_past_the_depth_limit_is_refused_at_its_line(nesting: str) -> None:
    [(field, line, message)] = refused(BASE + "env: " + nesting + "\n")

    assert field == "job spec"
    assert line is not None and line >= 7
    assert message == f"not valid YAML: nested deeper than {MAX_SPEC_DEPTH} levels"


def test_nesting_past_the_depth_limit_through_aliases_is_refused() -> None:
    level = "[" * 20 + "x" + "]" * 20
    text = f"a: &a {level}\nb: &b [{', '.join(['*a'] * 2)}]\n"
    text += "c: [[[[[[[[[[[[[[[[[[[[*b]]]]]]]]]]]]]]]]]]]]\n"

    assert "nested deeper than" in refused(text + BASE)[0][2]


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("nodes: " + "9" * 5000, "Exceeds the limit (4300 digits)"),
        ("gpu_type: 2001-13-45", "month must be in 1..12"),
        ("gpu_type: !!int abc", "invalid literal for int()"),
        ("gpu_type: !!float abc", "could not convert string to float"),
    ],
    ids=["5000-digit integer", "no such date", "!!int", "!!float"],
)
def test_a_scalar_yaml_cannot_build_is_refused_at_its_line(line: str, problem: str) -> None:
    [(field, at, message)] = refused(BASE + line + "\n")

    assert (field, at) == ("job spec", 7)
    assert message.startswith("not valid YAML: cannot read ") and problem in message


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("max_runtime: .inf", "max_runtime"),
        ("max_runtime: " + "9" * 400 + "s", "max_runtime"),
        ("grace_period: .nan", "grace_period"),
        ("restart: {hang_timeout: .inf}", "restart.hang_timeout"),
        ("checkpoint: {interval: {steps: 1e999}}", "checkpoint.interval.steps"),
    ],
)
def test_an_infinite_or_nan_number_is_refused_as_not_finite(line: str, field: str) -> None:
    problems = {f: m for f, _, m in refused(BASE + line + "\n")}

    assert "Input should be a finite number" in problems[field]


def test_a_json_spec_with_an_infinite_duration_is_refused_too() -> None:
    with pytest.raises(JobSpecError, match="max_runtime: Input should be a finite number"):
        validate_spec({**load_spec(BASE).model_dump(mode="json"), "max_runtime": float("inf")})


def test_a_spec_over_a_mib_is_refused_before_it_is_parsed() -> None:
    [(_, _, message)] = refused(BASE + "#" * MAX_SPEC_CHARS)

    assert message.endswith(f"characters; at most {MAX_SPEC_CHARS}")


def test_unknown_keys_are_each_refused_by_name_and_line() -> None:
    problems = {(f, ln): m for f, ln, m in refused(BASE + "nodez: 3\nplacement: {polcy: x}\n")}

    assert problems[("nodez", 7)] == "Extra inputs are not permitted"
    assert problems[("placement.polcy", 8)] == "Extra inputs are not permitted"


def test_a_nul_character_is_refused_as_not_yaml() -> None:
    assert "not valid YAML: unacceptable character" in refused(BASE + "team: a\x00b\n")[0][2]


# --- properties ---------------------------------------------------------------------------

FIELDS = ["name", "team", "command", "workdir", "nodes", "ranks_per_node", "env", "checkpoint"]
YAML_BITS = st.sampled_from(
    ["[", "]", "{", "}", ": ", "- ", "&a ", "*a", "<<: ", "!!int ", "!!binary ", "!!set ",
     "? ", ", ", "\n", "  ", "'", '"', "#", "|", ">", "~", ".inf", "1e999", "2001-13-45",
     "9" * 30, "\t", "%YAML 1.1\n", "---\n", "...\n", "!", "\\", "@", "`", "\x00", "\ud800"]
    + [f"{f}: " for f in FIELDS]
)  # fmt: skip
SETTINGS = settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def only_job_spec_errors(text: str) -> None:
    with contextlib.suppress(JobSpecError):
        load_spec(text)


@SETTINGS
@given(st.text(max_size=400))
def test_any_text_loads_or_is_a_job_spec_error(text: str) -> None:
    only_job_spec_errors(text)


@SETTINGS
@given(st.lists(YAML_BITS | st.text(max_size=5), max_size=60).map("".join))
def test_any_yaml_shaped_text_loads_or_is_a_job_spec_error(text: str) -> None:
    only_job_spec_errors(text)


@SETTINGS
@given(st.lists(YAML_BITS | st.text(max_size=5), max_size=30).map("".join))
def test_any_text_after_a_valid_spec_loads_or_is_a_job_spec_error(text: str) -> None:
    only_job_spec_errors(BASE + text)


JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(FIELDS),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@SETTINGS
@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), JSONISH, max_size=8))
def test_any_object_validates_or_is_a_job_spec_error(data: dict[str, object]) -> None:
    with contextlib.suppress(JobSpecError):
        validate_spec(data)
