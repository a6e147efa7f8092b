"""Where the CLI takes its API token from: never only its command line, which every user
of the machine reads in ``ps`` (issue 16: no token in a process title)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.cli import commands as cli

TOKEN = "cli-token-0123456789abcdef"


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PHALANX_API", "PHALANX_TOKEN", "PHALANX_CA"):
        monkeypatch.delenv(name, raising=False)


def test_the_token_comes_from_the_file_named_by_token_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    args = cli.parser().parse_args(
        ["--api", "http://127.0.0.1:1", "--token-file", str(path), "nodes"]
    )
    assert cli._client(args).token == TOKEN


def test_an_unreadable_token_file_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    args = cli.parser().parse_args(
        ["--api", "http://127.0.0.1:1", "--token-file", str(missing), "nodes"]
    )
    with pytest.raises(cli.CliError, match=str(missing)) as raised:
        cli._client(args)
    assert raised.value.code == cli.EXIT_USAGE


def test_without_a_token_the_hint_names_the_environment_or_a_file_not_a_flag_value() -> None:
    args = cli.parser().parse_args(["nodes"])
    with pytest.raises(cli.CliError) as raised:
        cli._client(args)
    assert "--token-file" in str(raised.value)
    assert "--token " not in str(raised.value) and not str(raised.value).endswith("--token")


def test_an_empty_token_file_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("\n")
    args = cli.parser().parse_args(
        ["--api", "http://127.0.0.1:1", "--token-file", str(path), "nodes"]
    )
    with pytest.raises(cli.CliError, match="is empty"):
        cli._client(args)
