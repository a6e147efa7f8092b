"""What the checkpoint routes need from the agent that serves them.

The rank socket's routes and the peer routes depend on ``CkptHost``, not on
``agentd.daemon.Agent``: the node's name, its checkpoint service, and its ranks'
progress (a rank waiting on its checkpoints is not hung). ``Agent`` is one;
``Standalone`` is the host of a checkpoint service served alone (a benchmark's
agent, a test's), whose ranks' progress nobody watches.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from agentd.ckpt.service import CkptService

__all__ = ["CkptHost", "Progress", "Standalone", "Unwatched"]


class Progress(Protocol):
    """The ranks' progress, as far as the checkpoint routes touch it."""

    def waiting(self, job: str, rank: int) -> contextlib.AbstractContextManager[None]:
        """While the block runs, the rank waits on its checkpoints: no step comes, and
        that is no hang."""
        ...


class CkptHost(Protocol):
    """What the checkpoint routes need from the agent serving them."""

    @property
    def node(self) -> str: ...

    @property
    def ckpt(self) -> CkptService: ...

    @property
    def progress(self) -> Progress: ...


class Unwatched:
    """Progress nobody watches."""

    def waiting(self, job: str, rank: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@dataclass(frozen=True, slots=True)
class Standalone:
    """A checkpoint service served alone: no rank's progress is watched."""

    node: str
    ckpt: CkptService
    progress: Progress = field(default_factory=Unwatched)
