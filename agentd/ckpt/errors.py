"""How the checkpoint service refuses a rank's request: ``CkptRequestError`` carries the
HTTP status to answer and what else the answer says (``ckpt.protocol.ErrorReply``)."""

from __future__ import annotations

from typing import Any

from ckpt import CheckpointError, FormatError, ShardCorrupt, TierError, UnsupportedVersion

__all__ = ["CkptRequestError", "copy_failed"]


class CkptRequestError(Exception):
    """A rank's request the agent refuses; ``status`` is the HTTP status to answer,
    ``extra`` the answer's other fields (``tier``, ``step``, ``corrupt``)."""

    def __init__(self, message: str, status: int = 400, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


def copy_failed(exc: CheckpointError, *, tier: str, step: int) -> CkptRequestError:
    """The answer to a rank whose copy of ``step`` at ``tier`` (the peer or the object
    store) could not be read: 502, naming the tier and the step, and ``corrupt`` when the
    copy itself is proven bad (it does not verify, decompress or parse: the rank reports
    it, and the catalog stops offering it), not when the tier could not be reached or
    the copy is of a format too new for this reader (a rolling upgrade)."""
    if isinstance(exc, TierError):
        return CkptRequestError(str(exc), status=502, tier=tier, step=step, corrupt=exc.corrupt)
    corrupt = isinstance(exc, ShardCorrupt | FormatError) and not isinstance(
        exc, UnsupportedVersion
    )
    return CkptRequestError(
        f"tier {tier}: {exc}", status=502, tier=tier, step=step, corrupt=corrupt
    )
