"""The supervisor's errors, one family: each carries the ids that matter as attributes.

Nothing here knows HTTP: the REST API maps each error to its status
(:func:`supervisor.api.app.http_status`). The pure scheduler keeps its own family
(:mod:`supervisor.scheduler`), as it imports nothing of the supervisor's.
"""

from __future__ import annotations

from pathlib import Path


class SupervisorError(Exception):
    """Base of the supervisor's errors."""


class RegistryError(SupervisorError):
    """An operator request about a node that the registry refuses as asked (a bad value)."""


class UnknownNode(RegistryError):
    def __init__(self, node: str) -> None:
        super().__init__(f"node {node!r} is not known to this supervisor")
        self.node = node


class Refused(RegistryError):
    """A request that cannot be done in the current state (undrain a sick node, cancel an
    ended job)."""


class UnknownJob(SupervisorError):
    def __init__(self, job: str) -> None:
        super().__init__(f"job {job!r} is not known to this supervisor")
        self.job = job


class CommandTimeout(SupervisorError, TimeoutError):
    """No ack for a command within its timeout."""

    def __init__(self, node: str, op: str, command_id: str, timeout: float) -> None:
        super().__init__(
            f"no ack from node {node!r} for {op} command {command_id} within {timeout:.1f}s"
        )
        self.node, self.op, self.command_id, self.timeout = node, op, command_id, timeout


class LaunchError(SupervisorError):
    """A gang launch that failed; ``node``: the first node that did not start its part."""

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


class IllegalTransition(SupervisorError):
    """A job state change its state machine does not allow (``supervisor.jobs.TRANSITIONS``);
    ``frm`` and ``to`` are the two ``JobState`` values."""

    def __init__(self, job: str, frm: str, to: str) -> None:
        super().__init__(f"job {job}: illegal transition {frm} -> {to}")
        self.job, self.frm, self.to = job, frm, to


class StoreError(SupervisorError):
    """The state database cannot be opened, read or written; ``path`` names it."""

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(message)
        self.path = path


class StoreCorrupt(StoreError):
    """The state database is damaged (SQLite says the disk image is malformed, or the file
    is not a database); ``detail``: what SQLite found, ``backups``: the folder of the
    rolling backups to restore from (None: none configured)."""

    def __init__(self, path: Path, detail: str, backups: Path | None) -> None:
        where = (
            f"copy the newest state-*.db of {backups} in its place"
            if backups is not None
            else "copy a backup of it in its place"
        )
        super().__init__(
            path,
            f"the supervisor store {path} is corrupt ({detail}); to recover, stop the "
            f"supervisor, move {path.name} and its -wal and -shm files aside, {where}, and "
            "start it again (docs/operations.md, 'The store's safety')",
        )
        self.detail = detail
        self.backups = backups


class Unauthorized(SupervisorError):
    """A request whose token (or session) is missing, wrong, expired or revoked (401)."""


class Forbidden(SupervisorError):
    """A valid token asking for something outside its role (403); ``needs``: what it
    lacks, ``action`` and ``target`` what it asked for (recorded as an ``auth_denied``
    event)."""

    def __init__(self, message: str, *, action: str, needs: str, target: str | None) -> None:
        super().__init__(message)
        self.action, self.needs, self.target = action, needs, target


class UnknownToken(SupervisorError):
    def __init__(self, token: str) -> None:
        super().__init__(f"token {token!r} is not known to this supervisor")
        self.token = token
