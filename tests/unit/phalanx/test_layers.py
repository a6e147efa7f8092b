"""The packages meet where the architecture says (docs/architecture.md): ``phalanx`` and
``ckpt`` are below both daemons and import neither; the daemons import each other never."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _imported_packages(package: str) -> dict[str, set[str]]:
    """Each module file of ``package`` -> the top-level packages it imports (any import,
    under ``TYPE_CHECKING`` and inside functions too)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tops: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                tops.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = tops
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("phalanx", {"agentd", "supervisor"}),
        ("ckpt", {"agentd", "supervisor"}),
        ("agentd", {"supervisor"}),
        ("supervisor", {"agentd"}),
    ],
)
def test_a_package_imports_nothing_above_or_beside_it(package: str, forbidden: set[str]) -> None:
    wrong = {
        f: sorted(t & forbidden) for f, t in _imported_packages(package).items() if t & forbidden
    }
    assert not wrong, f"{package} imports {forbidden}: {wrong}"
