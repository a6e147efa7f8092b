"""A test's own processes, found in /proc by what their environment carries.

Every process a test starts (the daemons, the CLI, and the ranks, which inherit their
agent's environment) carries this pytest process's mark (``OWNER``), so that a test looks
only at its own processes: never at those of a test running beside it in another
pytest-xdist worker, or of another run on the machine. Each fleet's daemons and ranks also
carry their fleet's (``FLEET_ENV``): what outlives a test's fleet (the ranks of an agent
killed with SIGKILL, which nobody reaps) is ended with it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

# Not PHALANX_*: the ranks are told exactly which PHALANX_ variables they get.
OWNER_ENV = "PHX_TEST_OWNER"
OWNER = uuid.uuid4().hex
os.environ[OWNER_ENV] = OWNER
FLEET_ENV = "PHX_TEST_FLEET"


def processes_marked(mark: dict[str, str]) -> list[int]:
    """Pids of the processes whose environment holds ``mark`` (one variable)."""
    ((key, value),) = mark.items()
    wanted = f"{key}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def processes_matching(marker: str) -> list[int]:
    """Pids of live (non-zombie) processes of this pytest process (``OWNER``) whose command
    line contains ``marker``."""
    mine = f"{OWNER_ENV}={OWNER}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if marker not in cmdline or int(entry.name) == os.getpid():
                continue
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
            owned = mine in (entry / "environ").read_bytes().split(b"\0")
        except (OSError, UnicodeDecodeError):
            continue
        if state != "Z" and owned:
            found.append(int(entry.name))
    return found


def rank_pid(
    job: str, rank: int, *, generation: int | None = None, marker: str = "examples/tinylm.py"
) -> int | None:
    """The pid of a live rank process of ``job`` (its command line holds ``marker``),
    read from its environment; of ``generation`` only, when given."""
    for pid in processes_matching(marker):
        try:
            env = dict(
                item.split("=", 1)
                for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                if "=" in item
            )
        except OSError:
            continue
        if (
            env.get("PHALANX_JOB_ID") == job
            and env.get("RANK") == str(rank)
            and (generation is None or env.get("PHALANX_GENERATION") == str(generation))
        ):
            return pid
    return None
