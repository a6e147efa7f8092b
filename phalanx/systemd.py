"""Telling systemd how a daemon is doing: readiness, status, stopping and the watchdog.

The sd_notify protocol is one datagram of newline-separated ``KEY=VALUE``
lines sent to the AF_UNIX socket that systemd names in ``$NOTIFY_SOCKET`` (a
path, or ``@name`` for the abstract namespace). That is a dozen lines of
standard library, so Phalanx speaks it directly instead of depending on a
package for it (``sdnotify`` on PyPI is the same few lines, unmaintained since
2017, and untyped).

With ``WatchdogSec=`` in the unit, systemd also passes ``$WATCHDOG_USEC`` (and
``$WATCHDOG_PID``, the process meant to pet) and restarts the service when no
``WATCHDOG=1`` arrives within that period. :meth:`Notifier.keep_watchdog`
pets every half period from a task on the daemon's own event loop, so an event
loop that hangs (a blocking call, a coroutine that never yields) stops the
petting and systemd restarts the daemon.

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op, so the daemons
behave the same under a terminal, the tests and the local fleet.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 1.0
"""A send blocks at most this long (systemd's socket queue full); the message is then dropped."""

_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """The daemon's line to systemd; every method is a no-op when ``address`` is None."""

    def __init__(self, address: str | None, watchdog_period_s: float | None = None) -> None:
        self.address = address
        self.watchdog_period_s = watchdog_period_s

    @classmethod
    def from_environment(cls, *, unset: bool = True) -> Notifier:
        """Read ``$NOTIFY_SOCKET`` and the watchdog variables.

        With ``unset`` (the default) the variables are removed from the
        environment, so child processes (a job's ranks) neither inherit the
        socket nor believe they are the process that must pet the watchdog.
        """
        env = {name: os.environ.get(name, "") for name in _VARIABLES}
        if unset:
            for name in _VARIABLES:
                os.environ.pop(name, None)
        return cls(
            env["NOTIFY_SOCKET"] or None,
            _watchdog_period(env["WATCHDOG_USEC"], env["WATCHDOG_PID"]),
        )

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` assignments in one datagram; True when systemd got it."""
        if self.address is None:
            return False
        target = _socket_address(self.address)
        if target is None:
            log.warning(
                "NOTIFY_SOCKET=%r is not a unix socket path or @abstract name; "
                "not notifying systemd",
                self.address,
            )
            return False
        message = "\n".join(assignments).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendto(message, target)
        except TimeoutError:
            log.warning(
                "systemd notify socket %s: send blocked for over %.1fs; dropped %s",
                self.address,
                SEND_TIMEOUT_S,
                _keys(assignments),
            )
            return False
        except OSError as exc:
            log.warning(
                "systemd notify socket %s: cannot send %s: %s",
                self.address,
                _keys(assignments),
                exc,
            )
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """The daemon is up: systemd ends the start job (``Type=notify``)."""
        return self.notify("READY=1", *_status(status))

    def stopping(self, status: str | None = None) -> bool:
        """The daemon began an orderly stop."""
        return self.notify("STOPPING=1", *_status(status))

    def status(self, text: str) -> bool:
        """A one-line status that ``systemctl status`` shows."""
        return self.notify(*_status(text))

    def pet(self) -> bool:
        """Reset the watchdog timer."""
        return self.notify("WATCHDOG=1")

    async def keep_watchdog(self) -> None:
        """Pet the watchdog every half period, forever; returns at once without a watchdog."""
        period = self.watchdog_period_s
        if self.address is None or period is None:
            return
        log.debug("petting the systemd watchdog every %.1fs", period / 2)
        while True:
            self.pet()
            await asyncio.sleep(period / 2)


def _watchdog_period(usec: str, pid: str) -> float | None:
    if not usec:
        return None
    if pid and pid.strip() != str(os.getpid()):
        return None  # the watchdog belongs to another process (we are its child)
    try:
        value = int(usec)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer; not petting the watchdog", usec)
        return None
    if value <= 0:
        log.warning("WATCHDOG_USEC=%r is not positive; not petting the watchdog", usec)
        return None
    return value / 1_000_000


def _socket_address(address: str) -> str | None:
    if address.startswith("@"):
        return "\0" + address[1:]
    if address.startswith("/"):
        return address
    return None  # e.g. vsock:CID:PORT (systemd 254+ in VMs): not used on bare metal


def _status(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    return ("STATUS=" + " ".join(text.split()),)  # one line: a newline would start a new key


def _keys(assignments: tuple[str, ...]) -> str:
    return ",".join(a.split("=", 1)[0] for a in assignments)
