"""Settings: flags > environment > file > defaults, and every bad input names its field."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import agentd.config
import supervisor.config
from agentd.config import AgentSettings
from phalanx.settings import ConfigError, load_settings
from supervisor.config import SupervisorSettings


@pytest.fixture(autouse=True)
def hermetic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No stray PHALANX_* variable, and default config paths that do not exist."""
    for name in list(os.environ):
        if name.startswith("PHALANX_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(agentd.config, "DEFAULT_CONFIG", tmp_path / "absent-agentd.toml")
    monkeypatch.setattr(supervisor.config, "DEFAULT_CONFIG", tmp_path / "absent-sup.toml")


def _toml(tmp_path: Path, text: str, name: str = "agentd.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_apply_when_nothing_is_set() -> None:
    settings = agentd.config.load([])

    assert settings.mqtt.port == 1883
    assert settings.heartbeat_interval_s == 5.0
    assert settings.thresholds.drain_xids == [46, 48, 64, 74, 79, 95]


def test_the_file_overrides_the_default(tmp_path: Path) -> None:
    path = _toml(tmp_path, "heartbeat_interval_s = 1.5\n[mqtt]\nport = 1000\n")

    settings = agentd.config.load(["--config", str(path)])

    assert (settings.mqtt.port, settings.heartbeat_interval_s) == (1000, 1.5)


def test_the_environment_overrides_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, "[mqtt]\nport = 1000\n")
    monkeypatch.setenv("PHALANX_AGENTD_MQTT__PORT", "2000")

    assert agentd.config.load(["--config", str(path)]).mqtt.port == 2000


def test_a_flag_overrides_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _toml(tmp_path, "[mqtt]\nport = 1000\n")
    monkeypatch.setenv("PHALANX_AGENTD_MQTT__PORT", "2000")

    assert agentd.config.load(["--config", str(path), "--mqtt.port", "3000"]).mqtt.port == 3000


def test_layers_merge_field_by_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _toml(tmp_path, 'rack = "r7"\n[mqtt]\nhost = "broker.example"\n')
    monkeypatch.setenv("PHALANX_AGENTD_MQTT__PORT", "2000")

    settings = agentd.config.load(["--config", str(path), "--heartbeat-interval-s", "2"])

    assert settings.rack == "r7"
    assert (settings.mqtt.host, settings.mqtt.port) == ("broker.example", 2000)
    assert settings.heartbeat_interval_s == 2.0


def test_a_top_level_environment_variable_sets_its_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PHALANX_AGENTD_NODE_ID", "env-node")

    assert agentd.config.load([]).node_id == "env-node"


def test_the_config_environment_variable_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, 'rack = "from-env-file"\n')
    monkeypatch.setenv("PHALANX_AGENTD_CONFIG", str(path))

    assert agentd.config.load([]).rack == "from-env-file"


def test_nested_thresholds_are_set_from_the_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[thresholds]\ndrain_xids = [79]\nxid_hold_s = 60\n")

    thresholds = agentd.config.load(["--config", str(path)]).thresholds

    assert (thresholds.drain_xids, thresholds.xid_hold_s) == ([79], 60.0)


def test_an_unknown_key_in_the_file_raises_config_error_naming_it(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[mqtt]\nprot = 1883\n")

    with pytest.raises(ConfigError, match=r"mqtt\.prot"):
        agentd.config.load(["--config", str(path)])


def test_an_unknown_top_level_key_in_the_file_raises_config_error_naming_it(
    tmp_path: Path,
) -> None:
    path = _toml(tmp_path, "heartbeat_intreval_s = 3\n")

    with pytest.raises(ConfigError, match="heartbeat_intreval_s"):
        agentd.config.load(["--config", str(path)])


def test_an_unknown_flag_raises_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="--no-such-flag"):
        agentd.config.load(["--no-such-flag", "1"])


def test_a_bad_flag_value_raises_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"mqtt\.port"):
        agentd.config.load(["--mqtt.port", "0"])


def test_a_bad_environment_value_raises_config_error_naming_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PHALANX_AGENTD_GPU__BACKEND", "cuda")

    with pytest.raises(ConfigError, match=r"gpu\.backend"):
        agentd.config.load([])


def test_a_bad_file_value_raises_config_error_naming_the_field(tmp_path: Path) -> None:
    path = _toml(tmp_path, "heartbeat_interval_s = -1\n")

    with pytest.raises(ConfigError, match="heartbeat_interval_s"):
        agentd.config.load(["--config", str(path)])


def test_an_invalid_node_id_raises_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="node_id"):
        agentd.config.load(["--node-id", "not/valid"])


def test_a_file_that_is_not_toml_raises_config_error_naming_the_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "this is [not toml\n")

    with pytest.raises(ConfigError, match=re.escape(str(path))):
        agentd.config.load(["--config", str(path)])


def test_a_named_config_file_that_does_not_exist_raises(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"

    with pytest.raises(ConfigError, match="does not exist"):
        agentd.config.load(["--config", str(missing)])


def test_a_config_file_named_by_the_environment_that_does_not_exist_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_AGENTD_CONFIG", str(tmp_path / "missing.toml"))

    with pytest.raises(ConfigError, match=r"missing\.toml"):
        agentd.config.load([])


def test_a_missing_default_file_is_fine(tmp_path: Path) -> None:
    settings = load_settings(
        AgentSettings,
        [],
        prog="phalanx-agentd",
        env_prefix="PHALANX_AGENTD_",
        default_config=tmp_path / "nowhere" / "agentd.toml",
    )

    assert settings.mqtt.port == 1883


def test_an_existing_default_file_is_read(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[mqtt]\nport = 1999\n")

    settings = load_settings(
        AgentSettings, [], prog="phalanx-agentd", env_prefix="PHALANX_AGENTD_", default_config=path
    )

    assert settings.mqtt.port == 1999


def test_the_supervisor_follows_the_same_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(
        tmp_path,
        "offline_after_s = 30\n[api]\nport = 1\n[mqtt]\nport = 1000\n",
        name="supervisor.toml",
    )
    monkeypatch.setenv("PHALANX_SUPERVISOR_API__PORT", "2")
    monkeypatch.setenv("PHALANX_SUPERVISOR_MQTT__PORT", "2000")

    settings = supervisor.config.load(["--config", str(path), "--mqtt.port", "3000"])

    assert settings.offline_after_s == 30.0
    assert settings.api.port == 2
    assert settings.mqtt.port == 3000


def test_a_bad_supervisor_value_raises_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="offline_after_s"):
        supervisor.config.load(["--offline-after-s", "0"])


def test_the_agentd_environment_does_not_configure_the_supervisor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PHALANX_AGENTD_MQTT__PORT", "2000")

    assert supervisor.config.load([]).mqtt.port == 1883


def _supervisor(**api: object) -> SupervisorSettings:
    return SupervisorSettings.model_validate({"api": api})


def test_api_token_reads_the_token_file_stripped(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("0123456789abcdef0123\n")

    assert _supervisor(token_file=token_file).api_token() == "0123456789abcdef0123"


def test_api_token_prefers_the_token_file_to_the_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file-0123456789")

    settings = _supervisor(token_file=token_file, token="from-the-settings-0123456789")

    assert settings.api_token() == "from-the-file-0123456789"


def test_api_token_falls_back_to_the_token() -> None:
    settings = _supervisor(token="from-the-settings-0123456789")

    assert settings.api_token() == "from-the-settings-0123456789"


def test_api_token_refuses_a_missing_token_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"api\.token_file"):
        _supervisor(token_file=tmp_path / "absent").api_token()


def test_api_token_refuses_a_short_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("short\n")

    with pytest.raises(ConfigError, match="at least 16"):
        _supervisor(token_file=token_file).api_token()


def test_api_token_refuses_to_run_without_a_token() -> None:
    with pytest.raises(ConfigError, match=r"api\.token"):
        _supervisor().api_token()


def test_an_unknown_environment_variable_under_the_prefix_is_rejected_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PHALANX_AGENTD_HEARTBEAT_INTERVAL", "3")

    with pytest.raises(ConfigError, match="PHALANX_AGENTD_HEARTBEAT_INTERVAL"):
        agentd.config.load([])


def test_a_bad_secret_value_is_not_echoed_in_the_error(tmp_path: Path) -> None:
    conf = _toml(tmp_path, "[mqtt]\npassword = 982734982734\n")

    with pytest.raises(ConfigError) as err:
        agentd.config.load(["--config", str(conf)])

    assert "mqtt.password" in str(err.value)
    assert "982734982734" not in str(err.value)


def test_write_cpus_name_cpus_this_node_has_and_leave_the_ranks_one(tmp_path: Path) -> None:
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("one usable CPU: nothing can be kept for the write-down")
    kept = agentd.config.load(
        ["--config", str(_toml(tmp_path, f"[ckpt]\nwrite_cpus = [{usable[-1]}, {usable[-1]}]\n"))]
    )
    assert kept.ckpt.write_cpus == [usable[-1]]

    with pytest.raises(ConfigError, match=r"ckpt\.write_cpus.*4095.*not among"):
        agentd.config.load(["--config", str(_toml(tmp_path, "[ckpt]\nwrite_cpus = [4095]\n"))])
    with pytest.raises(ConfigError, match=r"ckpt\.write_cpus.*leaves the ranks no CPU"):
        agentd.config.load(["--config", str(_toml(tmp_path, f"[ckpt]\nwrite_cpus = {usable}\n"))])


def test_the_agents_ranks_pass_env_is_read_from_the_file_and_a_bad_name_is_refused(
    tmp_path: Path,
) -> None:
    path = _toml(tmp_path, '[ranks]\npass_env = ["AWS_ACCESS_KEY_ID"]\n')
    assert agentd.config.load(["--config", str(path)]).ranks.pass_env == ["AWS_ACCESS_KEY_ID"]

    bad = _toml(tmp_path, '[ranks]\npass_env = ["A=B"]\n', name="bad.toml")
    with pytest.raises(ConfigError, match=r"ranks\.pass_env.*not environment variable names"):
        agentd.config.load(["--config", str(bad)])


def test_brokers_are_listed_in_order_and_take_the_default_port() -> None:
    settings = agentd.config.load(["--mqtt.brokers", '["mqtt-a:1884", "mqtt-b", "[fd00::7]:8883"]'])

    assert settings.mqtt.endpoints() == [("mqtt-a", 1884), ("mqtt-b", 1883), ("fd00::7", 8883)]


def test_brokers_come_from_the_file_and_host_alone_is_one_broker(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[mqtt]\nbrokers = ["a:1", "b:2"]\n')

    assert agentd.config.load(["--config", str(path)]).mqtt.endpoints() == [("a", 1), ("b", 2)]
    assert agentd.config.load(["--mqtt.host", "c"]).mqtt.endpoints() == [("c", 1883)]


@pytest.mark.parametrize(
    ("brokers", "says"),
    [
        ("a:1,a:1", "lists 'a:1' twice"),
        ("a:0", "no valid port"),
        ("a:http", "no valid port"),
        ("fd00::7", "write an IPv6 address as"),
        ("[fd00::7", "is not \\[ADDRESS\\]:PORT"),
        ("user@a:1", "no valid host"),
    ],
)
def test_a_bad_broker_entry_is_refused_naming_it(
    brokers: str, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_AGENTD_MQTT__BROKERS", brokers)  # comma-separated
    with pytest.raises(ConfigError, match=says):
        agentd.config.load([])


def test_a_host_and_a_broker_list_together_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"either as mqtt.host .* or as mqtt.brokers"):
        agentd.config.load(["--mqtt.host", "a", "--mqtt.brokers", "b:1"])
