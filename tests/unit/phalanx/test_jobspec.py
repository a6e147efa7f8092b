"""The job spec: what loads, what is refused, and that errors name the field and its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.jobspec import FromFile, JobSpec, JobSpecError, load_spec, load_spec_file

# Lines 1-6; a test appends its own fields from line 7 on.
BASE = """\
name: tinylm
team: research
command: [python, train.py]
workdir: /srv/tinylm
nodes: 2
ranks_per_node: 4
"""
REQUIRED = ("name", "team", "command", "workdir", "nodes", "ranks_per_node")


def load(extra: str = "") -> JobSpec:
    return load_spec(BASE + extra)


def errors(text: str) -> list[tuple[str, int | None, str]]:
    with pytest.raises(JobSpecError) as caught:
        load_spec(text)
    return caught.value.errors


def fields(text: str) -> set[str]:
    return {field for field, _, _ in errors(text)}


# --- a valid spec ----------------------------------------------------------------


def test_minimal_spec_loads_with_documented_defaults() -> None:
    spec = load()
    assert (spec.name, spec.team, spec.command, spec.workdir) == (
        "tinylm",
        "research",
        ["python", "train.py"],
        "/srv/tinylm",
    )
    assert (spec.priority, spec.env, spec.gpu_type, spec.preemptible) == (50, {}, None, False)
    assert (spec.placement.policy, spec.placement.required) == ("pack", False)
    assert (spec.max_runtime, spec.grace_period) == (86400.0, 30.0)
    assert spec.checkpoint.interval == "auto"
    assert spec.checkpoint.tiers == ["ram", "nvme", "peer", "object"]
    assert spec.checkpoint.keep == {"ram": 2, "nvme": 3, "peer": 2, "object": 5}
    assert (spec.restart.max_restarts, spec.restart.use_spares) == (3, True)


def test_full_spec_loads_every_field() -> None:
    spec = load("""\
priority: 700
env:
  OMP_NUM_THREADS: "1"
  WANDB_API_KEY: {from_file: /etc/phalanx/secrets/wandb}
gpu_type: NVIDIA H100 80GB HBM3
placement: {policy: spread, required: true}
max_runtime: 15m
preemptible: true
grace_period: 10
checkpoint:
  interval: {steps: 500}
  tiers: [ram, object]
  keep: {ram: 1, object: 9}
restart: {max_restarts: 0, use_spares: false}
""")
    assert spec.priority == 700
    assert spec.env == {
        "OMP_NUM_THREADS": "1",
        "WANDB_API_KEY": FromFile(from_file=Path("/etc/phalanx/secrets/wandb")),
    }
    assert spec.gpu_type == "NVIDIA H100 80GB HBM3"
    assert (spec.placement.policy, spec.placement.required) == ("spread", True)
    assert (spec.max_runtime, spec.preemptible, spec.grace_period) == (900.0, True, 10.0)
    assert spec.checkpoint.interval == {"steps": 500}
    assert spec.checkpoint.tiers == ["ram", "object"]
    assert spec.checkpoint.keep == {"ram": 1, "object": 9}
    assert (spec.restart.max_restarts, spec.restart.use_spares) == (0, False)


def test_world_size_is_nodes_times_ranks_per_node() -> None:
    assert load().world_size == 2 * 4


def test_spec_file_loads_from_disk(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(BASE)
    assert load_spec_file(path).name == "tinylm"


def test_unreadable_spec_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(JobSpecError) as caught:
        load_spec_file(missing)
    assert caught.value.errors[0][0] == str(missing)


# --- durations -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("90", 90.0),
        ('"90s"', 90.0),
        ("15m", 900.0),
        ("2h", 7200.0),
        ("1.5d", 129600.0),
        ("2.5", 2.5),
    ],
)
def test_max_runtime_parses_durations(value: str, seconds: float) -> None:
    assert load(f"max_runtime: {value}\n").max_runtime == seconds


@pytest.mark.parametrize("value", ["soon", "0", "-1", "true", "0s", "3w", "[1]"])
def test_bad_max_runtime_is_refused_naming_the_field_and_line(value: str) -> None:
    assert [(f, ln) for f, ln, _ in errors(BASE + f"max_runtime: {value}\n")] == [
        ("max_runtime", 7)
    ]


def test_bad_duration_message_says_what_a_duration_looks_like() -> None:
    with pytest.raises(JobSpecError, match=r"max_runtime \(line 7\): 'soon' is not a duration"):
        load("max_runtime: soon\n")


# --- required, unknown and malformed ----------------------------------------------


@pytest.mark.parametrize("missing", REQUIRED)
def test_missing_required_field_is_named(missing: str) -> None:
    text = "".join(line + "\n" for line in BASE.splitlines() if not line.startswith(f"{missing}:"))
    assert errors(text) == [(missing, None, "Field required")]


def test_every_missing_required_field_is_named_at_once() -> None:
    assert fields("priority: 10\n") == set(REQUIRED)


def test_unknown_field_is_refused_with_its_line() -> None:
    assert errors(BASE + "nodez: 3\n") == [("nodez", 7, "Extra inputs are not permitted")]


def test_unknown_nested_field_is_refused_with_its_dotted_name_and_line() -> None:
    assert errors(BASE + "restart:\n  max_restarts: 1\n  retry: forever\n") == [
        ("restart.retry", 9, "Extra inputs are not permitted")
    ]


def test_yaml_syntax_error_reports_its_line() -> None:
    ((field, line, message),) = errors(BASE + "env:\n  A: b\n   C: d\n")
    assert (field, line) == ("job spec", 9)
    assert message.startswith("not valid YAML")


def test_yaml_syntax_error_names_the_source_file(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("command: [python\n")
    with pytest.raises(JobSpecError, match=rf"{path} \(line \d+\): not valid YAML"):
        load_spec_file(path)


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n", "", "# nothing\n"])
def test_document_that_is_not_a_mapping_is_refused(text: str) -> None:
    assert errors(text) == [("job spec", None, "a job spec is a mapping of fields")]


def test_error_message_lists_field_with_line() -> None:
    with pytest.raises(JobSpecError, match=r"nodes \(line 5\): Input should be greater than"):
        load_spec(BASE.replace("nodes: 2", "nodes: 0"))


# --- env -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "PHALANX_JOB_ID",
        "PHALANX_ANYTHING",
    ],
)
def test_env_name_phalanx_sets_is_refused(name: str) -> None:
    ((field, line, message),) = errors(BASE + f"env:\n  {name}: x\n")
    assert (field, line) == ("env", 7)
    assert f"{name} is set by Phalanx" in message


@pytest.mark.parametrize("name", ["1ABC", "A-B", "A B", "A.B", "Ä"])
def test_invalid_env_name_is_refused(name: str) -> None:
    ((field, _, message),) = errors(BASE + f"env:\n  '{name}': x\n")
    assert field == "env"
    assert "is not a valid environment variable name" in message


def test_env_name_that_merely_contains_a_reserved_word_is_allowed() -> None:
    assert load("env:\n  MY_RANK: x\n  NOT_PHALANX_X: y\n").env == {
        "MY_RANK": "x",
        "NOT_PHALANX_X": "y",
    }


def test_env_from_file_must_be_absolute() -> None:
    found = errors(BASE + "env:\n  TOKEN: {from_file: secrets/token}\n")
    assert ("env.TOKEN.from_file", 8, "from_file must be an absolute path on the node") in found


def test_env_value_with_unknown_key_is_refused() -> None:
    assert "env.TOKEN.from_env" in fields(BASE + "env:\n  TOKEN: {from_env: X}\n")


def test_redacted_spec_shows_the_reference_not_the_secret(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("hunter2-very-secret")
    spec = load(f"env:\n  TOKEN: {{from_file: {secret}}}\n  PLAIN: visible\n")
    shown = spec.redacted()
    assert shown["env"] == {"TOKEN": f"<from_file {secret}>", "PLAIN": "visible"}
    assert "hunter2" not in repr(shown)


def test_redacted_spec_keeps_every_other_field() -> None:
    shown = load().redacted()
    assert shown["name"] == "tinylm"
    assert shown["nodes"] == 2
    assert shown["placement"] == {"policy": "pack", "required": False}


# --- checkpoint and placement ----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("auto", "auto"),
        ("{steps: 500}", {"steps": 500.0}),
        ("{seconds: 90}", {"seconds": 90.0}),
    ],
)
def test_checkpoint_interval_accepts_auto_steps_or_seconds(value: str, parsed: object) -> None:
    assert load(f"checkpoint:\n  interval: {value}\n").checkpoint.interval == parsed


@pytest.mark.parametrize(
    "value",
    [
        "hourly",
        "{minutes: 5}",
        "{steps: 5, seconds: 60}",
        "{}",
        "{steps: 0}",
        "{seconds: -30}",
        "{steps: many}",
        "300",
    ],
)
def test_checkpoint_interval_rejects_anything_else(value: str) -> None:
    found = errors(BASE + f"checkpoint:\n  interval: {value}\n")
    assert {f for f, _, _ in found} <= {
        "checkpoint.interval",
        "checkpoint.interval.steps",
        "checkpoint.interval.seconds",
        "checkpoint.interval.minutes",
    }
    assert {ln for _, ln, _ in found} == {8}


def test_checkpoint_tier_must_be_known() -> None:
    assert fields(BASE + "checkpoint:\n  tiers: [ram, tape]\n") == {"checkpoint.tiers.1"}


def test_checkpoint_keep_must_be_at_least_one() -> None:
    assert fields(BASE + "checkpoint:\n  keep: {ram: 0}\n") == {"checkpoint.keep.ram"}


@pytest.mark.parametrize("policy", ["pack", "spread"])
def test_placement_policy_accepts_pack_and_spread(policy: str) -> None:
    assert load(f"placement:\n  policy: {policy}\n").placement.policy == policy


def test_placement_policy_rejects_other_values_naming_nested_field_and_line() -> None:
    with pytest.raises(
        JobSpecError,
        match=r"placement\.policy \(line 8\): Input should be "
        r"'pack' or 'spread'",
    ):
        load("placement:\n  policy: diagonal\n")


def test_error_in_a_list_item_names_its_index_and_line() -> None:
    assert errors(BASE.replace("[python, train.py]", "\n  - python\n  - {x: 1}")) == [
        ("command.1", 5, "Input should be a valid string")
    ]


def test_an_unquoted_number_in_env_becomes_its_string() -> None:
    from phalanx.jobspec import load_spec

    spec = load_spec(
        "name: a\nteam: t\ncommand: [x]\nworkdir: /\nnodes: 1\nranks_per_node: 1\n"
        "env:\n  OMP_NUM_THREADS: 1\n  RATIO: 0.5\n"
    )

    assert spec.env == {"OMP_NUM_THREADS": "1", "RATIO": "0.5"}


# --- a team from the API token (issue 16) ---------------------------------------------

NO_TEAM = BASE.replace("team: research\n", "")


def test_a_spec_without_a_team_takes_the_default_team() -> None:
    assert load_spec(NO_TEAM, default_team=lambda: "nlp").team == "nlp"


def test_a_spec_that_names_its_team_keeps_it_and_never_asks_for_the_default() -> None:
    def never() -> str:
        raise AssertionError("asked for the token's team though the spec names one")

    assert load_spec(BASE, default_team=never).team == "research"


def test_a_spec_without_a_team_and_no_default_team_is_refused_on_field_team() -> None:
    with pytest.raises(JobSpecError) as caught:
        load_spec(NO_TEAM, default_team=lambda: None)

    assert [f for f, _, _ in caught.value.errors] == ["team"]
    assert "the API token has none" in str(caught.value)


def test_without_a_default_team_a_spec_must_name_one() -> None:
    assert [f for f, _, _ in errors(NO_TEAM)] == ["team"]


@pytest.mark.parametrize(
    "example",
    # a sweep's file is no job spec: tests/unit/phalanx/test_sweepspec.py loads those
    [
        p
        for p in sorted((Path(__file__).parents[3] / "examples").glob("*.yaml"))
        if "sweep" not in p.name
    ],
    ids=lambda p: p.name,
)
def test_every_example_spec_loads(example: Path) -> None:
    spec = load_spec_file(example)
    assert spec.command[1] in ("tinylm.py", "zero1.py")  # beside the spec (workdir: .)
