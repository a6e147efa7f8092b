"""``phalanx-supervisor``: the fleet supervisor's entry point.

Exit codes: 0 clean stop, 2 bad configuration, 3 it led and lost the lead to a standby
(``supervisor.leadership``; systemd starts it again, as a standby), 1 anything else (a
port in use, an unwritable state directory).

On a PostgreSQL store it first stands by until it leads (``supervisor.standby``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from phalanx.logs import configure
from phalanx.run import run_until_signal
from phalanx.settings import ConfigError
from phalanx.systemd import Notifier
from supervisor import gcpolicy
from supervisor.config import load
from supervisor.daemon import Supervisor
from supervisor.errors import StoreError
from supervisor.leadership import EXIT_LOST, Leadership, default_api_url
from supervisor.standby import wait_for_lead

log = logging.getLogger("supervisor")


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        settings = load(args)
        settings.mqtt.resolved()
        token = settings.api_token()
    except ConfigError as exc:
        print(f"phalanx-supervisor: {exc}", file=sys.stderr)
        return 2
    configure(settings.log_level, json_lines=settings.log_json, name="supervisor")
    gcpolicy.tune()

    notifier = Notifier.from_environment()

    leadership: Leadership | None = None
    if settings.store.url:
        api = settings.api
        try:
            leadership = Leadership(
                settings.store.url,
                settings.state_dir / "state.db",
                api_url=settings.ha.api_url
                or default_api_url(api.host, api.port, api.tls_cert_file is not None),
                lease_s=settings.ha.lease_s,
                poll_s=settings.ha.poll_s,
            )
        except ValueError as exc:
            print(f"phalanx-supervisor: {exc}", file=sys.stderr)
            return 2

    async def serve(stop: asyncio.Event) -> None:
        if leadership is not None:
            loop = asyncio.get_running_loop()
            # Lost: stop at once, sending and writing nothing more (what it holds in
            # memory is the new leader's to decide); systemd starts it again, standing by.
            lead = leadership

            def lost() -> None:
                loop.call_soon_threadsafe(_step_down, lead)

            term = await wait_for_lead(
                settings, leadership, stop, on_lost=lost, ready=notifier.ready
            )
            if term is None:
                return
        async with Supervisor(settings, token, leadership=leadership) as supervisor:
            notifier.ready(f"serving: API on port {supervisor.api_port}")
            await stop.wait()
        if leadership is not None:
            leadership.close()  # the lock goes with its session: a standby leads at once

    try:
        asyncio.run(run_until_signal(serve, notifier))
    except ConfigError as exc:  # a file the settings name that proved unusable
        print(f"phalanx-supervisor: {exc}", file=sys.stderr)
        return 2
    except (OSError, StoreError) as exc:
        print(f"phalanx-supervisor: {exc}", file=sys.stderr)
        return 1
    return 0


def _step_down(leadership: Leadership) -> None:
    log.critical(
        "exiting (status %d): another supervisor leads now (%s)",
        EXIT_LOST,
        leadership.lost_reason,
    )
    logging.shutdown()
    os._exit(EXIT_LOST)


if __name__ == "__main__":
    sys.exit(main())
