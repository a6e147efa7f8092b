"""Running a daemon until a signal: the first SIGTERM/SIGINT stops it, a second forces exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def run_until_signal(serve: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Call ``serve(stop)``; ``stop`` is set on the first signal. A second one exits at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.error("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s received: shutting down", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await serve(stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
