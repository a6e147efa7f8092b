"""The supervisor's modules depend on each other in one direction: no import circle.

Every import counts, those under ``if TYPE_CHECKING:`` and inside functions too: a
circle hidden from the interpreter is still one for the reader. The daemon wires the
parts together, so nothing but the entry point imports it, and nothing but the daemon
imports the REST API.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import supervisor

ROOT = Path(supervisor.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Each supervisor module -> the supervisor modules it imports."""
    files = {_module(p): p for p in sorted(ROOT.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in files:
                        found.add(target)
                    elif base in files:
                        found.add(base)
        found.discard(name)
        graph[name] = found
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph.get(name, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)) is not None:
            return found
    return None


def test_no_supervisor_module_imports_another_that_imports_it_back() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("module", "allowed"),
    [("supervisor.daemon", {"supervisor.__main__"}), ("supervisor.api.app", {"supervisor.daemon"})],
)
def test_only_the_layer_above_imports_the_daemon_and_the_api(
    module: str, allowed: set[str]
) -> None:
    importers = {name for name, targets in _graph().items() if module in targets}
    assert importers <= allowed


@pytest.mark.parametrize(
    "module",
    [
        "supervisor.control.controller",
        "supervisor.checkpoints.publisher",
        "supervisor.recovery.executor",
    ],
)
def test_the_job_and_catalog_parts_import_neither_the_daemon_nor_the_api(module: str) -> None:
    graph = _graph()
    reachable, todo = set(), [module]
    while todo:
        for target in graph[todo.pop()] - reachable:
            reachable.add(target)
            todo.append(target)
    assert not reachable & {"supervisor.daemon", "supervisor.api.app"}


# The wings, bottom first: a module may import its own wing and the lines below it only.
LAYERS: list[set[str]] = [
    {"supervisor.errors", "supervisor.records", "supervisor.gcpolicy"},
    {
        "supervisor.config",
        "supervisor.jobs",
        "supervisor.store_db",
        "supervisor.store_guard",
        "supervisor.gcdefer",  # its release freezes what piled up (gcpolicy.freeze_held)
    },
    {"supervisor.store", "supervisor.leadership"},
    {"supervisor.backup", "supervisor.standby"},
    {"supervisor.telemetry", "supervisor.auth", "supervisor.scheduler"},
    {"supervisor.fleet"},
    {"supervisor.checkpoints"},
    {"supervisor.actuator"},
    {"supervisor.recovery"},
    {"supervisor.control"},
    {"supervisor.sweeps"},
    {"supervisor.dashboard"},
    {"supervisor.api"},
    {"supervisor.daemon"},
    {"supervisor.__main__"},
]


def _wing(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _layer(wing: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if wing in layer)


def test_every_supervisor_module_belongs_to_a_wing_of_a_layer() -> None:
    unplaced = {_wing(m) for m in _graph()} - set().union(*LAYERS) - {"supervisor"}
    assert not unplaced, f"put these in a layer of LAYERS: {sorted(unplaced)}"


def test_a_wing_imports_only_itself_and_the_layers_below_it() -> None:
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in _graph().items()
        if _wing(name) != "supervisor"
        for target in targets
        if _wing(target) != _wing(name) and _layer(_wing(target)) >= _layer(_wing(name))
    )
    assert not upward, "imports against the layers: " + "; ".join(upward)


def test_the_circle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
