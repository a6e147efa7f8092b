"""``phalanx-agentd``: the node agent's entry point.

Exit codes: 0 clean stop, 2 bad configuration or no usable GPU backend,
1 anything else.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from agentd.config import load
from agentd.daemon import Agent
from agentd.gpu import GpuBackendError, open_backend
from phalanx.logs import configure
from phalanx.run import run_until_signal
from phalanx.settings import ConfigError
from phalanx.systemd import Notifier

log = logging.getLogger("agentd")


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        settings = load(args)
        settings.mqtt.resolved()
    except ConfigError as exc:
        print(f"phalanx-agentd: {exc}", file=sys.stderr)
        return 2
    configure(settings.log_level, json_lines=settings.log_json, name=f"agentd[{settings.node_id}]")
    try:
        backend = open_backend(settings)
    except GpuBackendError as exc:
        print(f"phalanx-agentd: cannot start: {exc}", file=sys.stderr)
        return 2

    notifier = Notifier.from_environment()

    async def serve(stop: asyncio.Event) -> None:
        async with Agent(settings, backend) as agent:
            notifier.ready(f"node {agent.node}: serving, HTTP port {agent.http_port}")
            await stop.wait()

    try:
        asyncio.run(run_until_signal(serve, notifier))
    except OSError as exc:
        print(f"phalanx-agentd: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
