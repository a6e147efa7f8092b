"""``phalanx-supervisor``: the fleet supervisor's entry point.

Exit codes: 0 clean stop, 2 bad configuration, 1 anything else (a port in
use, an unwritable state directory).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from phalanx.logs import configure
from phalanx.run import run_until_signal
from phalanx.settings import ConfigError
from phalanx.systemd import Notifier
from supervisor.config import load
from supervisor.daemon import Supervisor
from supervisor.errors import StoreError


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

    notifier = Notifier.from_environment()

    async def serve(stop: asyncio.Event) -> None:
        async with Supervisor(settings, token) as supervisor:
            notifier.ready(f"serving: API on port {supervisor.api_port}")
            await stop.wait()

    try:
        asyncio.run(run_until_signal(serve, notifier))
    except ConfigError as exc:  # a file the settings name that proved unusable
        print(f"phalanx-supervisor: {exc}", file=sys.stderr)
        return 2
    except (OSError, StoreError) as exc:
        print(f"phalanx-supervisor: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
