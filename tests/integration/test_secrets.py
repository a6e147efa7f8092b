"""Secrets stay secret (issue 16): a ``from_file`` env value reaches the ranks and nothing
else, and the fleet's tokens and broker passwords stay in the files that hold them.

One real fleet (Mosquitto with a password per user, the supervisor and two agents, all
logging at DEBUG) runs a job whose ranks get ``DB_PASSWORD`` from a file. Each rank checks
the value against its SHA-256 (never printing it), reports a step, saves a checkpoint that
lands at every tier, and waits to be let go, so that the process table is read while it
runs. The agents' HTTP secrets are per node: the fleet secret stays in the supervisor's
file, each node's token in that node's file, and each node's credential at its buddy
travels only in MQTT messages to that node (its start order, its catalog). A second job's
secret is a raw key, not text: its start fails, and the failure quotes none of it. An
admin makes an API token (its secret is in the answer that made it, and must be nowhere
else: the store keeps its hash), which is used, refused once and logs into the
dashboard. Then
every place Phalanx writes, serves, publishes or runs is searched for the bytes of every
secret: each file under the test's directory (the supervisor's SQLite database with its
-wal and -shm files, every log, the agents' data dirs, rank logs included, the object
store) and the agents' RAM tier, before and after the daemons stop; every API answer;
every MQTT message the broker carried; and the command line and name of every process of
the fleet, ranks included.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from phalanx import wire
from phalanx.agent_tokens import AgentKeys
from phalanx.client import ApiError, Client
from tests.harness import TOKEN, Broker, Fleet, RawMqtt, wait_for

pytestmark = pytest.mark.integration

NODES = ("n01", "n02")
OBSERVER = "observer"

# argv[1]: the SHA-256 of the value the rank should find in DB_PASSWORD; argv[2]: a file
# whose appearance lets the rank exit (0 with the right value, 3 without). Before it waits,
# it reports a step and saves a checkpoint, so that metrics and every checkpoint tier (the
# RAM slots, the disk, the buddy over HTTP, the object store) are among the places searched.
# Every wait is bounded: 30 s.
RANK = """\
import hashlib, os, pathlib, sys, time
import phalanx.rank
from ckpt import Checkpointer
ok = hashlib.sha256(os.environ.get("DB_PASSWORD", "").encode()).hexdigest() == sys.argv[1]
phalanx.rank.step(1, loss=0.5, tokens=8.0)
saver = Checkpointer(wait_timeout_s=30)
saver.save(1, {"step": 1, "note": "harmless"})
saver.wait()
saver.close()
print("rank", os.environ["RANK"], "has its secret" if ok else "LACKS its secret", flush=True)
release, deadline = pathlib.Path(sys.argv[2]), time.monotonic() + 30
while not release.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(0 if ok else 3)
"""


class Secrets:
    """Every secret of the fleet, by name, and the files that are allowed to hold them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.value = f"s3cr3t-{secrets.token_hex(16)}"
        self.token = ""  # the secret of an API token the test makes (issue 16)
        self.file = root / "secrets" / "db-password"
        self.file.parent.mkdir(parents=True)
        self.file.write_text(self.value + "\n")
        # A secret that is not text (a raw key): its start fails, and the error must not
        # quote it (Python's decode error names a byte and its offset).
        self.binary = self.file.with_name("raw-key")
        self.binary.write_bytes(b"\xa7\xfe" + secrets.token_bytes(14))
        self.passwords = {
            user: f"pw-{user}-{secrets.token_hex(12)}"
            for user in ("phalanx-supervisor", *NODES, OBSERVER)
        }
        for user, password in self.passwords.items():
            (self.file.parent / f"mqtt-{user}").write_text(password + "\n")
        # The broker's password file, hashed in place (-U): no password on a command line.
        self.passwd = root / "broker" / "passwd"
        self.passwd.parent.mkdir(parents=True)
        self.passwd.write_text("".join(f"{u}:{p}\n" for u, p in self.passwords.items()))
        tool = shutil.which("mosquitto_passwd") or "/usr/bin/mosquitto_passwd"
        subprocess.run([tool, "-U", str(self.passwd)], check=True, timeout=10)
        assert self.value not in self.passwd.read_text()

    def needles(self, fleet: Fleet) -> dict[str, bytes]:
        found = {
            "the from_file secret": self.value.encode(),
            "the raw key": self.binary.read_bytes(),
            "a decode error quoting a byte": b"can't decode byte",
            "the API token": TOKEN.encode(),
            "the fleet agent secret": fleet.agent_secret_file().read_text().strip().encode(),
        }
        for node in NODES:
            token = fleet.agent_token_file(node).read_text().strip()
            found[f"the agent token of {node}"] = token.encode()
        if self.token:
            found["an admin-made API token"] = self.token.encode()
            found["an admin-made API token's random part"] = self.token.split("_", 2)[2].encode()
        found.update({f"the broker password of {u}": p.encode() for u, p in self.passwords.items()})
        # Encoded the ways a message might carry bytes: base64 (a Basic auth header, a
        # binary field in JSON).
        found.update(
            {f"{name} (base64)": base64.b64encode(raw) for name, raw in list(found.items())}
        )
        return found

    def homes(self, fleet: Fleet) -> set[Path]:
        """The files whose job is to hold a secret."""
        return {
            *self.file.parent.iterdir(),
            self.passwd,
            fleet.root / "supervisor" / "token",
            fleet.agent_secret_file(),
            *(fleet.agent_token_file(node) for node in NODES),
        }

    def credentials(self, fleet: Fleet) -> dict[tuple[str, str], bytes]:
        """(holder, node) -> what ``node`` presents at ``holder``'s peer routes."""
        keys = AgentKeys(fleet.agent_secret_file().read_text().strip())
        return {
            (holder, node): str(keys.peer_credential(holder, node)).encode()
            for holder in NODES
            for node in NODES
            if holder != node
        }

    def mqtt(self, user: str) -> str:
        path = self.file.parent / f"mqtt-{user}"
        return f'username = "{user}"\npassword_file = "{path}"\n'


@pytest.fixture
def guarded(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Fleet, Secrets]]:
    """A fleet whose broker wants a password from everyone, with a secret for a job."""
    kept = Secrets(tmp_path)
    broker = Broker(
        tmp_path / "broker",
        # As whoever runs the test (as root it would drop to a user who cannot read it).
        conf_extra=f"password_file {kept.passwd}\nallow_anonymous false\nuser {_me()}\n",
    ).start()
    fleet = Fleet(tmp_path, broker)
    try:
        yield fleet, kept
    finally:
        fleet.stop()
        broker.stop()
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            for log in sorted((tmp_path / "logs").glob("*.log")):
                text = log.read_text(errors="replace")[-3000:]
                sys.stderr.write(f"\n----- {log.name} -----\n{text}")


def _refused_anonymous(port: int) -> bool:
    """Whether the broker turns away a client that brings no password (so that the daemons,
    which it lets in, present theirs)."""
    import paho.mqtt.client as mqtt

    answer = threading.Event()
    codes: list[Any] = []

    def connected(client: Any, userdata: Any, flags: Any, code: Any, props: Any) -> None:
        codes.append(code)
        answer.set()

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2)
    client.on_connect = connected
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        assert answer.wait(5), "no CONNACK from the broker within 5 s"
    finally:
        client.loop_stop()
        client.disconnect()
    return bool(codes[0].is_failure)


def _me() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


def _pids_under(roots: list[int]) -> list[int]:
    """The live processes ``roots`` and their descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    seen: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo.extend(children.get(pid, []))
    return seen


def _ranks_of(job: str, pids: list[int]) -> list[int]:
    """Those of ``pids`` that are ranks of ``job`` (the agent set PHALANX_JOB_ID for them)."""
    marker = f"PHALANX_JOB_ID={job}".encode()
    found = []
    for pid in pids:
        try:
            if marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            continue
    return found


def _titles(pids: list[int]) -> dict[str, bytes]:
    """Each process's command line (argv, NUL-separated, as a process title shows) and name."""
    found = {}
    for pid in pids:
        for part in ("cmdline", "comm"):
            try:
                found[f"/proc/{pid}/{part}"] = Path(f"/proc/{pid}/{part}").read_bytes()
            except OSError:
                continue
    return found


def _files(*roots: Path, skip: set[Path]) -> dict[str, bytes]:
    found = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path in skip or not path.is_file():
                continue
            try:
                found[str(path)] = path.read_bytes()
            except OSError:  # removed while we walked (a temp file renamed)
                continue
    return found


def _leaks(places: dict[str, bytes], needles: dict[str, bytes]) -> list[str]:
    return [
        f"{name} in {place}"
        for place, data in places.items()
        for name, needle in needles.items()
        if needle in data
    ]


def test_secrets_appear_nowhere_phalanx_writes_serves_publishes_or_runs(
    guarded: tuple[Fleet, Secrets],
) -> None:
    fleet, kept = guarded
    assert _refused_anonymous(fleet.broker.port)
    observer = RawMqtt(fleet.broker.port, auth=(OBSERVER, kept.passwords[OBSERVER]))
    try:
        observer.subscribe("#")
        observer.publish("test/secrets/probe", b"listening")
        wait_for(lambda: observer.received("test/secrets/probe"), 5, "the observer's probe")

        fleet.start_supervisor(extra='log_level = "DEBUG"\n', mqtt=kept.mqtt("phalanx-supervisor"))
        for node in NODES:
            fleet.start_agent(node, gpus=1, top='log_level = "DEBUG"\n', mqtt=kept.mqtt(node))
        for node in NODES:
            fleet.wait_state(node, "up")
        # A token an admin made (issue 16): its secret is in the answer that made it and
        # nowhere else. It is used, refused once (an auth_denied event, a warning logged)
        # and logs into the dashboard, so its traces are among the places searched.
        made = fleet.client().post("/v1/tokens", {"role": "member", "team": "ml", "name": "m"})
        kept.token = made["secret"]
        member = Client(fleet.api_url, kept.token, timeout=5)
        assert member.get("/v1/whoami")["id"] == made["id"]
        with pytest.raises(ApiError) as refused:
            member.post("/v1/nodes/n01/drain", {"reason": "not mine to drain"})
        assert refused.value.status == 403
        login = urllib.request.Request(
            f"{fleet.api_url}/ui/login",
            data=json.dumps({"token": kept.token}).encode(),
            headers={"X-Phalanx-CSRF": "1", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(login, timeout=5) as resp:
            cookie = resp.headers["Set-Cookie"]
        assert cookie.startswith("phalanx_session=v2.")
        release = fleet.root / "release"
        digest = hashlib.sha256(kept.value.encode()).hexdigest()
        job = fleet.submit(
            name="secrets",
            nodes=2,
            ranks_per_node=1,
            command=[sys.executable, "-c", RANK, digest, str(release)],
            env={"DB_PASSWORD": {"from_file": str(kept.file)}, "GREETING": "hello"},
            max_runtime="2m",
            grace_period=5,
        )
        job_id = job["id"]
        rank_logs = [
            fleet.root / "nodes" / node / "data" / "jobs" / job_id / "g1" / f"rank-{rank}.log"
            for rank, node in enumerate(NODES)
        ]

        def checked() -> bool:
            texts = [p.read_text() if p.exists() else "" for p in rank_logs]
            assert not any("LACKS" in t for t in texts), texts
            return all("has its secret" in t for t in texts)

        wait_for(checked, 40, "both ranks to check their secret and checkpoint")

        def committed() -> bool:
            steps = fleet.client().get(f"/v1/jobs/{job_id}/checkpoints")["steps"]
            return any(s["step"] == 1 and len(s["committed"]) == 4 for s in steps)

        wait_for(committed, 20, "step 1 committed at all four tiers")
        credentials = kept.credentials(fleet)
        needles = kept.needles(fleet)
        # A node's credential at its buddy is in no file, answer or process title at all.
        needles |= {f"{n}'s credential at {h}": c for (h, n), c in credentials.items()}
        homes = kept.homes(fleet)
        daemons = [p.pid for p in [fleet.supervisor, *fleet.agents.values()] if p is not None]
        assert fleet.broker.process is not None
        running = _pids_under([*daemons, fleet.broker.process.pid])
        assert len(_ranks_of(job_id, running)) == 2, "the ranks are not among those searched"
        leaks = _leaks(_titles(running), needles)
        leaks += _leaks(_files(fleet.root, fleet.shm_dir, skip=homes), needles)

        release.touch()
        ended = fleet.wait_job(job_id, "succeeded", timeout=30)
        assert [r["exit_code"] for r in ended["ranks"]] == [0, 0]
        raw = fleet.submit(
            name="raw-key",
            nodes=1,
            ranks_per_node=1,
            command=[sys.executable, "-c", "pass"],
            env={"RAW_KEY": {"from_file": str(kept.binary)}},
        )
        failed = fleet.wait_job(raw["id"], "failed", timeout=20)
        assert f"RAW_KEY: {kept.binary} on node" in failed["reason"], failed["reason"]
        assert "is not UTF-8 text" in failed["reason"], failed["reason"]

        client = fleet.client()
        paths = [
            "/v1/jobs",
            f"/v1/jobs/{job_id}",
            f"/v1/jobs/{job_id}/checkpoints",
            f"/v1/jobs/{job_id}/metrics",
            *(f"/v1/jobs/{job_id}/logs?rank={r}" for r in range(len(NODES))),
            f"/v1/jobs/{raw['id']}",
            "/v1/events?limit=10000",
            f"/v1/events?job={job_id}&limit=10000",
            "/v1/nodes",
            *(f"/v1/nodes/{n}" for n in NODES),
            "/v1/stats",
            "/metrics",
            "/v1/tokens",
            "/v1/whoami",
        ]
        answers = {f"GET {p}": client.get_bytes(p)[0] for p in paths}
        assert f"<from_file {kept.file}>".encode() in answers[f"GET /v1/jobs/{job_id}"]
        leaks += _leaks(answers, needles)
    finally:
        observer.close()
    fleet.stop()
    fleet.broker.stop()
    leaks += _leaks(_files(fleet.root, skip=homes), needles)
    carried = {f"MQTT {topic} #{i}": p for i, (topic, p) in enumerate(observer.heard())}
    assert any(t.startswith("MQTT phalanx/") for t in carried), "the observer heard nothing"
    leaks += _leaks(carried, {k: v for k, v in needles.items() if "credential" not in k})
    # The credentials do travel, each only to its own node (its start order and catalog).
    for (holder, node), credential in credentials.items():
        mine = (f"MQTT {wire.command_topic(node)} ", f"MQTT {wire.catalog_topic(job_id, node)} ")
        sent = [name for name, p in carried.items() if credential in p]
        assert sent, f"{node}'s credential at {holder} was never sent to {node}"
        leaks += [f"{node}'s credential at {holder} in {n}" for n in sent if not n.startswith(mine)]

    assert sorted(set(leaks)) == []
