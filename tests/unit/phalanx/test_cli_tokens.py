"""``phalanx token create|ls|revoke|whoami`` and ``phalanx submit`` with a team-less spec,
against the real supervisor app served on a free port (issue 16)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from phalanx.cli import commands as cli
from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from tests.unit.served import Served

TOKEN = "cli-bootstrap-0123456789abcdef"
SPEC = """\
name: train
command: [python, train.py]
workdir: /work
nodes: 1
ranks_per_node: 1
code_ref: {commit: abc123, dirty: false}
"""


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The supervisor's URL; the CLI's token is the bootstrap token unless a test says."""
    sups: list[Supervisor] = []

    async def build() -> web.Application:
        sups.append(Supervisor(SupervisorSettings(state_dir=tmp_path / "sup"), TOKEN))
        return make_app(sups[0])

    served = Served(build)
    monkeypatch.setenv("PHALANX_API", str(served.client.make_url("")).rstrip("/"))
    monkeypatch.setenv("PHALANX_TOKEN", TOKEN)
    monkeypatch.delenv("PHALANX_CA", raising=False)
    try:
        yield str(served.client.make_url(""))
    finally:
        served.close()
        sups[0].store.close()


def create(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert cli.main(["token", "create", *args]) == cli.EXIT_OK
    out = capsys.readouterr()
    assert "will not be shown again" in out.err
    return out.out.strip()


def test_token_create_prints_the_secret_once_and_ls_never_shows_it(
    api: str, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = create(capsys, "--role", "member", "--team", "nlp", "--name", "alice")

    assert cli.main(["token", "ls"]) == cli.EXIT_OK
    listed = capsys.readouterr().out

    assert secret.startswith("phx_t1_")
    assert "alice" in listed and "member" in listed and "nlp" in listed
    assert secret not in listed
    assert secret.removeprefix("phx_t1_") not in listed  # its random part may hold "_"


def test_token_whoami_names_the_token_the_cli_uses(
    api: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = create(capsys, "--role", "viewer", "--name", "wall", "--expires", "2d")
    monkeypatch.setenv("PHALANX_TOKEN", secret)

    assert cli.main(["token", "whoami"]) == cli.EXIT_OK

    assert capsys.readouterr().out.startswith("t1 (wall): viewer, expires 20")


def test_a_revoked_token_exits_1_saying_when_it_was_revoked(
    api: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = create(capsys, "--role", "operator")
    assert cli.main(["token", "revoke", "t1"]) == cli.EXIT_OK
    monkeypatch.setenv("PHALANX_TOKEN", secret)

    code = cli.main(["nodes"])

    assert code == cli.EXIT_FAILED
    assert "token t1 was revoked at" in capsys.readouterr().err


def test_a_request_outside_the_role_exits_refused_with_the_servers_reason(
    api: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_TOKEN", create(capsys, "--role", "viewer", "--name", "wall"))

    code = cli.main(["token", "create", "--role", "admin"])

    assert code == cli.EXIT_REFUSED
    assert "token 'wall' (viewer) cannot manage tokens: needs role admin" in (
        capsys.readouterr().err
    )


def test_submit_of_a_spec_without_a_team_takes_the_members_team(
    api: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PHALANX_TOKEN", create(capsys, "--role", "member", "--team", "nlp"))
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC)

    assert cli.main(["submit", str(spec)]) == cli.EXIT_OK
    job = capsys.readouterr().out.strip()
    assert cli.main(["status", job, "-o", "json"]) == cli.EXIT_OK

    assert '"team": "nlp"' in capsys.readouterr().out


def test_submit_of_a_spec_without_a_team_by_a_token_without_one_names_field_team(
    api: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(SPEC)

    code = cli.main(["submit", str(spec)])

    assert code == cli.EXIT_USAGE
    assert "team: the spec names no team and the API token has none" in capsys.readouterr().err


ELASTIC = (
    SPEC.replace("nodes: 1\nranks_per_node: 1", "nodes: 3\nranks_per_node: 2")
    + "team: nlp\nelastic: {min_nodes: 1, global_batch: 24, micro_batch: 2}\n"
)


def test_submit_of_an_elastic_spec_prints_its_sizes_and_status_shows_its_layout(
    api: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(ELASTIC)

    assert cli.main(["submit", str(spec)]) == cli.EXIT_OK
    out = capsys.readouterr()
    assert (
        "elastic: global batch 24 in micro batches of 2; allowed sizes in nodes: "
        "1 (2 ranks, accumulation 6), 2 (4 ranks, accumulation 3), 3 (6 ranks, accumulation 2)"
    ) in out.err
    assert cli.main(["status", out.out.strip()]) == cli.EXIT_OK
    assert (
        "elastic:     3 of 3 nodes (min 1), data-parallel 6, global batch 24 = micro batch 2 "
        "x 6 x accumulation 2"
    ) in capsys.readouterr().out


def test_submit_of_an_elastic_spec_with_no_allowed_size_is_refused_before_any_request(
    api: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(ELASTIC.replace("global_batch: 24", "global_batch: 10"))

    assert cli.main(["submit", str(spec)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "elastic (line 8): global_batch 10 is not a multiple of micro_batch 2" in err
    assert "allowed sizes from min_nodes 1 to 3: none" in err
