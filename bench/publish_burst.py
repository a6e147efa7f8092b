"""A launch's burst of QoS 1 publishes through the supervisor's broker link, at several
``mqtt.max_inflight`` settings in one run.

    python bench/publish_burst.py [--messages 2048 4096] [--size 1100] [--rounds 3]

A real Mosquitto, a consumer of every message in its own process (a paho client at QoS 1,
as the fleet's nodes take their orders), and the supervisor's own link
(``phalanx.link.MqttLinks``) publishing ``--messages`` messages of ``--size`` bytes at
once, one topic each, as a launch hands its start orders (1,100 bytes each at eight
ranks a node) or a commit its catalogs (~4,700 bytes) to the link. Timed: every publish
handed to the link (``handed_s``), and every one acknowledged by the broker
(``acked_s``). The settings compared: 0 (no limit, the default), 16,384 and 1,000 (the
earlier defaults) and 20 (paho's). Past a limit paho looks through every message in
flight, at each acknowledgement, for a queued one to send: a cost that grows with the
square of the burst. Prints JSON: the median of ``--rounds`` rounds per setting and size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phalanx.link import MqttLinks
from phalanx.local import find_mosquitto, free_port, write_mosquitto_conf
from phalanx.settings import MqttSettings

SETTINGS = (0, 16384, 1000, 20)
CONSUMER = """
import sys
import paho.mqtt.client as mqtt
c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-burst-consumer")
c.on_connect = lambda client, *_: client.subscribe("phalanx/v1/node/+/cmd", qos=1)
c.on_subscribe = lambda *_: print("subscribed", flush=True)
c.connect("127.0.0.1", int(sys.argv[1]))
c.loop_forever()
"""


async def burst(port: int, inflight: int, messages: int, size: int) -> tuple[float, float]:
    """One burst on a fresh link: (handed, acked) seconds."""
    links = MqttLinks(
        MqttSettings(port=port, max_inflight=inflight),
        f"bench-burst-{inflight}",
        subscriptions=[],
        handler=lambda *_: None,
    )
    async with links:
        await links.wait_connected(10)
        payload = b"x" * size
        t0 = time.perf_counter()
        sends = [
            asyncio.ensure_future(
                links.publish(f"phalanx/v1/node/n{i:05d}/cmd", payload, timeout=120)
            )
            for i in range(messages)
        ]
        await asyncio.sleep(0)  # each send's task ran up to its wait for the broker
        handed = time.perf_counter() - t0
        await asyncio.gather(*sends)
        return handed, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--size", type=int, default=1100, help="bytes a message")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--settings", type=int, nargs="+", default=list(SETTINGS), help="max_inflight values"
    )
    args = ap.parse_args()
    mosquitto = find_mosquitto()
    if mosquitto is None:
        sys.exit("bench/publish_burst.py needs Mosquitto (apt-get install -y mosquitto-clients)")
    port = free_port()
    out: dict[str, Any] = {"bench": "publish_burst", "size": args.size, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="phalanx-burst-") as tmp:
        conf = Path(tmp) / "mosquitto.conf"
        write_mosquitto_conf(conf, port, extra="max_queued_messages 0\nmax_queued_bytes 0\n")
        broker = subprocess.Popen(
            [mosquitto, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        consumer: subprocess.Popen[bytes] | None = None
        try:
            time.sleep(0.5)  # the broker listening
            consumer = subprocess.Popen(
                [sys.executable, "-c", CONSUMER, str(port)], stdout=subprocess.PIPE
            )
            assert consumer.stdout is not None
            if consumer.stdout.readline().strip() != b"subscribed":  # or it ended: EOF
                sys.exit("bench/publish_burst.py: the consumer could not subscribe")
            results: dict[str, Any] = {}
            for messages in args.messages:
                for inflight in args.settings:
                    runs = [
                        asyncio.run(burst(port, inflight, messages, args.size))
                        for _ in range(args.rounds)
                    ]
                    results[f"{messages}@{inflight}"] = {
                        "messages": messages,
                        "max_inflight": inflight,
                        "handed_s": round(statistics.median(h for h, _ in runs), 3),
                        "acked_s": round(statistics.median(a for _, a in runs), 3),
                    }
            out["bursts"] = list(results.values())
            for messages in args.messages:
                ours = results[f"{messages}@0"]["acked_s"]
                for inflight in args.settings[1:]:
                    theirs = results.get(f"{messages}@{inflight}")
                    if theirs is not None and ours > 0:
                        out[f"speedup_{messages}_vs_{inflight}"] = round(
                            theirs["acked_s"] / ours, 2
                        )
        finally:
            for proc in (consumer, broker):
                if proc is not None:
                    proc.terminate()
                    try:
                        proc.wait(10)
                    except subprocess.TimeoutExpired:
                        proc.kill()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
