"""The files of a local fleet that hold its API token are its owner's alone."""

from __future__ import annotations

import stat
from pathlib import Path

from phalanx import local


def test_the_fleet_file_which_holds_the_api_token_is_readable_by_its_owner_only(
    tmp_path: Path,
) -> None:
    fleet = local.Fleet(str(tmp_path), "http://127.0.0.1:1", "local-token-0123456789", 1, [])
    (tmp_path / "fleet.json.tmp").write_text("left by a crash")  # mode 0644 with umask 022
    fleet.save()
    path = tmp_path / "fleet.json"
    assert "local-token-0123456789" in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert local.Fleet.load(tmp_path).token == "local-token-0123456789"
