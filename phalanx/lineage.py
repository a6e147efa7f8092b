"""A job's lineage on the submitting machine: the git commit of its workdir."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

GIT_TIMEOUT_S = 10.0


def code_ref_of(workdir: Path) -> dict[str, Any] | None:
    """``{"commit", "dirty", "source"}`` of the git checkout holding ``workdir``; None
    when there is none (no git, not a checkout, not a folder here) or git fails."""
    git = shutil.which("git")
    if git is None or not workdir.is_dir():
        return None

    def run(*args: str) -> str | None:
        try:
            done = subprocess.run(
                [git, "-C", str(workdir), *args],
                capture_output=True,
                text=True,
                timeout=GIT_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = run("rev-parse", "HEAD")
    if not commit:
        return None
    status = run("status", "--porcelain", "--untracked-files=no")
    source = run("config", "--get", "remote.origin.url")
    return {"commit": commit, "dirty": bool(status), "source": source or None}
