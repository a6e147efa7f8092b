"""A live barrage: garbage on every MQTT topic the daemons read and garbage REST requests
to the supervisor and both agents, against a running fleet (real Mosquitto, supervisor,
two agents). Afterwards both kinds of daemon are alive, every node is in the state it
was in, nothing was answered 5xx, and a job submitted right after runs to success.

Bounded: a fixed, seeded set of 665 messages (35 payloads on each of 19 topics) and 500
requests, plus 7 requests aiohttp cannot parse to each server; the barrage itself takes
a few seconds, the whole test under half a minute.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from typing import Any
from urllib.parse import quote

import pytest

from phalanx import wire
from tests.harness import TOKEN, Fleet, RawMqtt

pytestmark = pytest.mark.integration

NODES = ("n01", "n02")
GHOST_JOB = "j-ghost"
CHECKSUM = "xxh3_128:" + "0" * 32


def deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def shapes() -> list[dict[str, Any]]:
    """Valid-looking payloads of every kind: each is garbage on every topic but its own,
    and on its own names ids that do not exist (a ghost job, an unknown command)."""
    now = time.time()
    return [
        {"kind": "heartbeat", "node": "n01", "seq": 1, "n": 0, "sent_at": now,
         "health": {"status": "ok"}},
        {"kind": "ack", "id": "no-such-command", "node": "n01", "status": "done",
         "result": {}, "acked_at": now},
        {"kind": "rank", "node": "n01", "job": GHOST_JOB, "generation": 1, "rank": 0,
         "event": "exited", "code": 1, "at": now},
        {"kind": "rank", "node": "n01", "job": GHOST_JOB, "generation": 2**62, "rank": 2**62,
         "event": "hung", "pid": 2**62, "step": 10**12 - 1, "idle_s": 1e300, "at": 1e300},
        {"kind": "ckpt", "node": "n01", "job": GHOST_JOB, "step": 10**12 - 1, "rank": 99_999,
         "tier": "nvme", "nbytes": 2**63 - 1, "checksum": CHECKSUM, "at": now},
        {"kind": "ckpt_released", "node": "n01", "job": GHOST_JOB, "at": now},
        {"kind": "ckpt_catalog", "job": GHOST_JOB, "node": "n01", "world_size": 2**40,
         "generation": 2**40, "restore_step": 10**18,
         "steps": [{"step": 5, "committed": {"peer": now},
                    "shards": [{"rank": 0, "checksum": CHECKSUM, "nbytes": 2**63 - 1,
                                "peer": {"node": "ghost", "address": "192.0.2.1",
                                         "http_port": 9}}]}]},
        {"kind": "cmd", "id": "barrage-1", "node": "n01", "issued_at": now,
         "deadline": now + 30, "args": {"op": "format-disk"}},
        {"kind": "cmd", "id": "barrage-2", "node": "n01", "issued_at": now,
         "deadline": now + 30,
         "args": {"op": "stop_ranks", "job": GHOST_JOB, "generation": 1}},
        {"kind": "supervisor", "online": "yes", "since": "now"},
    ]  # fmt: skip


def junk(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.randrange(9 if depth < 4 else 5)
    if roll == 0:
        return None
    if roll == 1:
        return rng.choice([True, False])
    if roll == 2:
        return rng.choice([0, -1, 2**63, 2**64, 10**30, rng.randrange(-1000, 1000)])
    if roll == 3:
        return rng.choice([1.5, -0.0, 1e308, -1e308])
    if roll == 4:
        return rng.choice(["", "n01", "ghost", GHOST_JOB, "x" * 1000, "\u0000", "../.."])
    if roll in (5, 6):
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        rng.choice(["kind", "node", "job", "id", "seq", "args", "health", "x"]): junk(
            rng, depth + 1
        )
        for _ in range(rng.randrange(5))
    }


def mutate(rng: random.Random, shape: dict[str, Any]) -> dict[str, Any]:
    out = dict(shape)
    key = rng.choice(list(out))
    if rng.random() < 0.3:
        del out[key]
    else:
        out[key] = junk(rng)
    return out


def mqtt_payloads(rng: random.Random) -> list[bytes]:
    payloads = [
        b"\x00\xff\xfe not json",
        b"{",
        b"null",
        b"[]",
        b'"a string"',
        b"A" * (wire.MAX_PAYLOAD_BYTES + 1),
        deep(50_000),
        b'{"a":' * 20_000 + b"1" + b"}" * 20_000,
        ("\ud800" * 10).encode("utf-8", "surrogatepass"),
    ]
    payloads += [json.dumps(s).encode() for s in shapes()]
    payloads += [json.dumps(mutate(rng, rng.choice(shapes()))).encode() for _ in range(12)]
    payloads += [rng.randbytes(rng.randrange(1, 300)) for _ in range(4)]
    return payloads


def mqtt_topics() -> list[str]:
    kinds = [
        wire.birth_topic,
        wire.death_topic,
        wire.heartbeat_topic,
        wire.command_topic,
        wire.ack_topic,
        wire.rank_topic,
        wire.ckpt_topic,
    ]
    return [
        *(k("n01") for k in kinds),
        *(k("ghost") for k in kinds),
        wire.catalog_topic(GHOST_JOB, "n01"),
        wire.catalog_topic(GHOST_JOB, "n02"),
        wire.SUPERVISOR_STATUS_TOPIC,
        "phalanx/v1/node/bad id!/heartbeat",
        "phalanx/v1/job/../ckpt/n01",
    ]


# Requests that are valid and change the fleet (a drain with a reason, a cancel) are
# never sent: the bodies below are garbage, or name what does not exist.
SUPERVISOR_ROUTES = [
    ("GET", "/v1/nodes/{id}"),
    ("POST", "/v1/nodes/{id}/drain"),
    ("POST", "/v1/nodes/{id}/undrain"),
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs/{id}"),
    ("POST", "/v1/jobs/{id}/cancel"),
    ("GET", "/v1/jobs/{id}/logs"),
    ("GET", "/v1/jobs/{id}/checkpoints"),
    ("GET", "/v1/events"),
    ("GET", "/v1/stats"),
    ("DELETE", "/v1/nodes"),
    ("GET", "/v1/%2e%2e/%2e%2e/etc/passwd"),
    ("GET", "/" + "a" * 4000),
]
AGENT_ROUTES = [
    ("GET", "/v1/jobs/{id}/ranks/0/log"),
    ("GET", "/v1/jobs/{id}/ranks/{id}/log"),
    ("PUT", "/v1/ckpt/peer/objects/j-ghost/000000000001/rank-00000.phx"),
    ("PUT", "/v1/ckpt/peer/objects/j-ghost/000000000001/rank-00000.phx.zst"),
    ("PUT", "/v1/ckpt/peer/objects/j-ghost/000000000001/manifest.json"),
    ("PUT", "/v1/ckpt/peer/objects/{id}"),
    ("GET", "/v1/ckpt/peer/objects/{id}"),
    ("GET", "/v1/ckpt/peer/keys"),
    ("POST", "/v1/ckpt/peer/delete"),
    ("GET", "/metrics"),
]


def bodies(rng: random.Random) -> bytes:
    choice = rng.randrange(6)
    if choice == 0:
        return b""
    if choice == 1:
        return rng.randbytes(rng.randrange(1, 500))
    if choice == 2:
        return deep(rng.randrange(1, 20_000))
    if choice == 3:
        return json.dumps({"spec": junk(rng), "reason": junk(rng), "force": "maybe"}).encode()
    if choice == 4:
        return json.dumps({"keys": [junk(rng)]}).encode()
    return json.dumps(junk(rng)).encode()


def request(
    port: int, method: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        conn.request(method, path, body=body or None, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def rest_barrage(
    rng: random.Random, port: int, routes: list[tuple[str, str]], token: str, count: int
) -> list[tuple[int, str, str, bytes]]:
    """``count`` garbage requests; the ones answered 5xx, with what they were."""
    ids = ["ghost", GHOST_JOB, "", "..", "%00", "%2e%2e%2f", "x" * 300, "9" * 40, "n01"]
    failed = []
    for _ in range(count):
        method, template = rng.choice(routes)
        path = template.replace("{id}", quote(rng.choice(ids), safe="%"))
        if rng.random() < 0.5:
            keys = ["limit", "after", "node", "job", "rank", "offset", "prefix", "x"]
            query = {rng.choice(keys): str(junk(rng))[:200] for _ in range(rng.randrange(1, 4))}
            path += "?" + "&".join(f"{k}={quote(v, safe='')}" for k, v in query.items())
        auth = rng.choice([f"Bearer {token}"] * 7 + ["Bearer wrong", token, ""])
        headers = {"Authorization": auth} if auth else {}
        if rng.random() < 0.3:
            headers["Content-Type"] = rng.choice(
                ["application/json; charset=nope", "text/plain", "multipart/form-data"]
            )
        body = bodies(rng)
        if path.endswith("/drain") and b'"reason"' in body:
            body = b'{"reason": 7}'  # never a drain that could pass
        status, answer = request(port, method, path, body, headers)
        if status >= 500:
            failed.append((status, method, path, answer[:300]))
    return failed


MALFORMED = [
    b"GET / HTTP/1.1\r\n\r\n",  # no Host
    b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",  # a line past 8 KiB
    b"GARBAGE\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS client hello
    b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 200 + b"\r\n",  # 200 headers
]


def malformed(port: int) -> list[bytes]:
    """Send each request aiohttp cannot parse; the status lines answered."""
    answers = []
    for data in MALFORMED:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(data)
            answers.append(sock.recv(200).split(b"\r\n", 1)[0])
    return answers


def test_a_barrage_of_garbage_leaves_the_fleet_as_it_was_and_able_to_run_a_job(
    fleet: Fleet,
) -> None:
    fleet.start_supervisor()
    for node in NODES:
        fleet.start_agent(node, gpus=1)
    before = {node: fleet.wait_state(node, "up")["state"] for node in NODES}
    agent_ports = {node: fleet.node(node)["http_port"] for node in NODES}
    rng = random.Random(16)
    started = time.monotonic()

    raw = RawMqtt(fleet.broker.port)
    try:
        for topic in mqtt_topics():
            for payload in mqtt_payloads(rng):
                raw.publish(topic, payload)
    finally:
        raw.close()
    failed = rest_barrage(rng, fleet.api_port, SUPERVISOR_ROUTES, TOKEN, 300)
    for node in NODES:
        token = fleet.agent_token_file(node).read_text().strip()  # the node's own: it opens
        failed += rest_barrage(rng, agent_ports[node], AGENT_ROUTES, token, 100)
    unparsed = {port: malformed(port) for port in [fleet.api_port, *agent_ports.values()]}
    barrage_s = time.monotonic() - started

    assert failed == []
    for answers in unparsed.values():
        assert all(a.startswith(b"HTTP/1.") and b" 400 " in a for a in answers), answers
    assert barrage_s < 120
    assert fleet.supervisor is not None and fleet.supervisor.alive()
    assert all(fleet.agents[node].alive() for node in NODES)
    fleet.wait_heartbeats(2 * len(NODES))  # a node knocked over by the barrage would show it
    assert {node: fleet.node(node)["state"] for node in NODES} == before
    assert fleet.client().get("/v1/stats")["bad_messages"] > 0

    job = fleet.submit(name="after", nodes=2, ranks_per_node=1, command=["bash", "-c", "exit 0"])
    done = fleet.wait_job(job["id"], "succeeded", timeout=60)

    assert done["state"] == "succeeded"
    for process in [fleet.supervisor, *fleet.agents.values()]:
        assert "Traceback" not in process.output(), process.name
