"""Supervised background loops: a loop that crashes is logged and restarted, never lost."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from phalanx.link import Backoff

log = logging.getLogger(__name__)


async def supervised(
    name: str, loop: Callable[[], Awaitable[None]], *, max_delay: float = 30.0
) -> None:
    """Run ``loop`` forever; restart it with capped backoff when it raises."""
    backoff = Backoff(0.5, max_delay)
    while True:
        try:
            await loop()
            log.warning("loop %s returned; restarting it", name)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("loop %s crashed; restarting it", name)
        await asyncio.sleep(backoff.next())
