"""The systemd units: `systemd-analyze verify` clean, hardened, and what the roles install.

No systemd runs in the test container, so the units are checked offline: `verify` loads them
with their dependencies and checks every directive and the ExecStart binary; `security
--offline` scores their sandboxing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.rollout.rollout_env import REPO, FleetTree

pytestmark = pytest.mark.rollout

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze is missing: it comes with Debian's `systemd` package "
    "(apt-get install -y systemd); it is not on PyPI",
)
UNITS = {
    "phalanx-agentd.service": "opt/phalanx/venv/bin/phalanx-agentd",
    "phalanx-supervisor.service": "opt/phalanx-supervisor/venv/bin/phalanx-supervisor",
}
ROLE_OF = {
    "phalanx-agentd.service": ("gpu-a01", "agent"),
    "phalanx-supervisor.service": ("sup1", "supervisor"),
}


def _analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run([SYSTEMD_ANALYZE, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def unit_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root holding the shipped units, systemd's own units, and the ExecStart binaries."""
    root = tmp_path_factory.mktemp("unit-root")
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit, binary in UNITS.items():
        shutil.copy(REPO / "systemd" / unit, root / "etc/systemd/system" / unit)
        stub = root / binary
        stub.parent.mkdir(parents=True)
        stub.write_text("#!/bin/sh\n")
        stub.chmod(0o755)
    return root


@needs_systemd_analyze
@pytest.mark.parametrize("unit", sorted(UNITS))
def test_shipped_unit_passes_systemd_analyze_verify(unit_root: Path, unit: str) -> None:
    result = _analyze("verify", f"--root={unit_root}", unit)

    # verify exits 0 even on unknown or malformed directives; it only prints them.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@needs_systemd_analyze
@pytest.mark.parametrize("unit", sorted(UNITS))
def test_unit_installed_by_its_role_passes_systemd_analyze_verify(
    fleet_tree: FleetTree, unit: str
) -> None:
    host, _ = ROLE_OF[unit]
    path = fleet_tree.host(host) / "etc/systemd/system" / unit

    result = _analyze("verify", str(path))

    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_shipped_unit_is_its_role_template_rendered_with_the_defaults(
    fleet_tree: FleetTree, unit: str
) -> None:
    host, _ = ROLE_OF[unit]
    rendered = (fleet_tree.host(host) / "etc/systemd/system" / unit).read_text()

    first, rest = rendered.split("\n", 1)
    assert first.startswith("# ")  # ansible_managed
    assert rest.replace(str(fleet_tree.host(host)), "") == (REPO / "systemd" / unit).read_text()


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("unit", "most"), [("phalanx-agentd.service", 3.0), ("phalanx-supervisor.service", 2.0)]
)
def test_unit_sandboxing_keeps_its_exposure_score(unit_root: Path, unit: str, most: float) -> None:
    result = _analyze(
        "security",
        "--offline=yes",
        f"--root={unit_root}",
        f"--threshold={int(most * 10)}",
        "--no-pager",
        unit,
    )

    assert result.returncode == 0, result.stdout.splitlines()[-1:]
