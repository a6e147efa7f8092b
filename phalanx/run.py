"""Running a daemon until a signal: the first SIGTERM/SIGINT stops it, a second forces exit.

Under systemd (see :mod:`phalanx.systemd`) it also pets the watchdog from a
task on this event loop, and says ``STOPPING=1`` when a signal starts the
shutdown. ``READY=1`` is the daemon's to send, once it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable

from phalanx.systemd import Notifier

log = logging.getLogger(__name__)


async def run_until_signal(
    serve: Callable[[asyncio.Event], Awaitable[None]], notifier: Notifier | None = None
) -> None:
    """Call ``serve(stop)``; ``stop`` is set on the first signal. A second one exits at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    notifier = notifier or Notifier(None)

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.error("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s received: shutting down", signal.Signals(signum).name)
        notifier.stopping(f"{signal.Signals(signum).name} received: shutting down")
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    watchdog = asyncio.create_task(notifier.keep_watchdog(), name="systemd-watchdog")
    try:
        await serve(stop)
    finally:
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
