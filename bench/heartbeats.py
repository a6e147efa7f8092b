"""How many heartbeats per second one supervisor handles, with many nodes on one broker.

    python bench/heartbeats.py [--nodes 2048] [--heartbeats 100000] [--gpus 8]

A real Mosquitto and a real supervisor process; a load generator (one paho
client) publishes a birth for every simulated node, waits until the
supervisor knows them all, then publishes ``--heartbeats`` heartbeats (each
carrying 8 GPUs' gauges, like a real agent's) round-robin over the nodes as
fast as it can. The supervisor's own counter (``/v1/stats``) is sampled to
get its handling rate. Prints JSON; the figure to compare is the fleet's
steady load: nodes / heartbeat interval (2,048 nodes at 5 s = 410/s).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import paho.mqtt.client as mqtt

from phalanx import wire
from phalanx.client import ApiError, Client
from phalanx.local import find_mosquitto, free_port, write_mosquitto_conf

TOKEN = "bench-token-0123456789abcdef"


def health(gpus: int) -> wire.Health:
    return wire.Health(
        status=wire.HealthStatus.OK,
        gpus=[
            wire.GpuGauges(
                index=i,
                temperature_c=45.0,
                power_w=300.0,
                util_pct=97.0,
                mem_used_bytes=60 * 2**30,
                mem_total_bytes=80 * 2**30,
                ecc_sbe_volatile=0,
                ecc_dbe_volatile=0,
                retired_pages=0,
            )
            for i in range(gpus)
        ],
        host=wire.HostGauges(
            disk_free_bytes=2**40,
            disk_total_bytes=2**41,
            mem_available_bytes=2**40,
            mem_total_bytes=2**41,
            load1=12.0,
            cpu_count=128,
        ),
        sampled_at=time.time(),
    )


def birth(node: str, gpus: int, h: wire.Health) -> bytes:
    return wire.encode(
        wire.NodeBirth(
            node=node,
            seq=1,
            hostname=node,
            address="127.0.0.1",
            http_port=9400,
            gpus=[
                wire.GpuDescriptor(
                    index=i, uuid=f"GPU-{node}-{i}", model="H100", memory_bytes=80 * 2**30
                )
                for i in range(gpus)
            ],
            gpu_backend="sim",
            topology=wire.Topology(rack=f"rack{int(node[1:]) % 64}"),
            version="bench",
            started_at=time.time(),
            health=h,
        )
    )


def wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():  # type: ignore[operator]
                return
        except ApiError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--heartbeats", type=int, default=100_000)
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args()
    mosquitto = find_mosquitto()
    if mosquitto is None:
        sys.exit("bench/heartbeats.py needs Mosquitto (apt-get install -y mosquitto)")
    with tempfile.TemporaryDirectory(prefix="phalanx-hb-") as tmp:
        d = Path(tmp)
        port, api_port = free_port(), free_port()
        write_mosquitto_conf(
            d / "mosquitto.conf", port, extra="max_queued_messages 0\nmax_queued_bytes 0\n"
        )
        (d / "token").write_text(TOKEN)
        (d / "supervisor.toml").write_text(
            f'state_dir = "{d / "state"}"\noffline_after_s = 3600\nlog_level = "WARNING"\n'
            f"[mqtt]\nport = {port}\n[api]\nport = {api_port}\n"
            f'token_file = "{d / "token"}"\n'
        )
        procs = [
            subprocess.Popen(
                [mosquitto, "-c", str(d / "mosquitto.conf")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        ]
        time.sleep(0.3)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "supervisor", "--config", str(d / "supervisor.toml")]
            )
        )
        try:
            api = Client(f"http://127.0.0.1:{api_port}", TOKEN, timeout=10)
            wait(lambda: api.get("/v1/stats")["mqtt_connects"] >= 1, 30, "the supervisor")
            gen = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
            gen.max_queued_messages_set(0)
            gen.connect("127.0.0.1", port)
            gen.loop_start()
            h = health(args.gpus)
            nodes = [f"n{i:05d}" for i in range(args.nodes)]
            for node in nodes:
                gen.publish(wire.birth_topic(node), birth(node, args.gpus, h), qos=1)
            wait(lambda: api.get("/v1/stats")["nodes"] >= args.nodes, 120, "every birth")
            beats = [
                (
                    wire.heartbeat_topic(n),
                    wire.encode(wire.Heartbeat(node=n, seq=1, n=1, sent_at=time.time(), health=h)),
                )
                for n in nodes
            ]
            payload_bytes = len(beats[0][1])
            before = api.get("/v1/stats")["heartbeats"]
            samples: list[tuple[float, int]] = []
            t0 = time.monotonic()
            for i in range(args.heartbeats):
                topic, payload = beats[i % len(beats)]
                gen.publish(topic, payload, qos=0)
            published_s = time.monotonic() - t0
            last, stalled_since = -1, time.monotonic()
            while time.monotonic() - stalled_since < 3.0:
                count = api.get("/v1/stats")["heartbeats"] - before
                samples.append((time.monotonic(), count))
                if count != last:
                    last, stalled_since = count, time.monotonic()
                if count >= args.heartbeats:
                    break
                time.sleep(0.2)
            gen.loop_stop()
            gen.disconnect()
            handled = samples[-1][1]
            done_at = next(t for t, c in samples if c == handled)
            elapsed = done_at - t0
            print(
                json.dumps(
                    {
                        "bench": "supervisor_heartbeats",
                        "nodes": args.nodes,
                        "gpus_per_node": args.gpus,
                        "heartbeat_payload_bytes": payload_bytes,
                        "published": args.heartbeats,
                        "handled": handled,
                        "lost_in_broker_or_socket": args.heartbeats - handled,
                        "publish_seconds": round(published_s, 3),
                        "handle_seconds": round(elapsed, 3),
                        "handled_per_second": round(handled / elapsed, 1),
                        "fleet_load_per_second_at_5s_heartbeats": round(args.nodes / 5.0, 1),
                    },
                    indent=2,
                )
            )
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait(10)


if __name__ == "__main__":
    main()
