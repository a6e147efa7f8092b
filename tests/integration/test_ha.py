"""Two supervisors on one PostgreSQL: one leads, the other stands by and takes over.

Real processes throughout: the test session's PostgreSQL (``tests.pg``), Mosquitto, two
``phalanx-supervisor`` processes on the same store and broker, agents running tinylm on
gloo. The leader is killed (``kill -9``) or paused (SIGSTOP) while the job trains; the
job must keep training, the standby must lead and commit what landed meanwhile, and the
job must end with the undisturbed run's digest (``training``).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from phalanx import wire
from phalanx.client import Client
from phalanx.local import free_port
from tests.harness import TOKEN, Fleet, Process, RawMqtt, leader_of, rank_pid, wait_for
from tests.integration.training import (
    committed_step,
    final_digest,
    submit,
    undisturbed_digest,
)
from tests.pg import PgCluster

pytestmark = pytest.mark.integration

LEASE = "[ha]\nlease_s = 3.0\npoll_s = 0.5\n"


def start_pair(fleet: Fleet, pg: PgCluster) -> tuple[Process, Process, str, str]:
    """Supervisor A (leading) and B (standing by) on one new PostgreSQL store, and the
    fleet's client pointed at both, B first."""
    store = f'[store]\nurl = "{pg.new_database()}"\n{LEASE}'
    port_a, port_b = free_port(), free_port()
    url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    a = fleet.start_supervisor(sections=store, api_port=port_a)
    wait_for(lambda: (leader_of(url_a) or {}).get("leading"), 30, "A to lead")
    b = fleet.start_supervisor(sections=store, api_port=port_b, name="supervisor-b")
    fleet.api_urls = [url_b, url_a]
    return a, b, url_a, url_b


def training(fleet: Fleet, pg: PgCluster, name: str) -> tuple[Process, Process, str, str, str, int]:
    """``start_pair``, two nodes and a tinylm job that has committed step 20 in RAM:
    A, B, their URLs, the job and its newest committed step."""
    a, b, url_a, url_b = start_pair(fleet, pg)
    fleet.start_nodes(2)
    job = submit(fleet, name)
    fleet.wait_job(job, "running", timeout=60)
    step = wait_for(lambda: committed_step(fleet, job, 20, tier="ram"), 90, "step 20")
    return a, b, url_a, url_b, job, step


def term_of(url: str) -> int:
    return int((leader_of(url) or {}).get("term") or 0)


def took_over(b: Process, url_b: str, first: int) -> int:
    """B's term, once it leads: a newer one than A's ``first``."""
    wait_for(lambda: (leader_of(url_b) or {}).get("leading") or None, 30, "B to lead")
    term = term_of(url_b)
    assert term > first and f"leading now, term {term}" in b.output(), b.output()[-2000:]
    return term


def committed_steps(fleet: Fleet, job: str, tier: str) -> set[int]:
    events = fleet.client().get(f"/v1/events?job={job}&limit=5000")
    return {
        e["detail"]["step"]
        for e in events
        if e["kind"] == "ckpt_committed" and e["detail"]["tier"] == tier
    }


def test_the_standby_takes_over_from_a_killed_leader_and_the_job_never_stops(
    fleet: Fleet, pg_cluster: PgCluster
) -> None:
    a, b, url_a, url_b = start_pair(fleet, pg_cluster)
    # The standby names the leader; a client that asks it first is sent on.
    standby = leader_of(url_b)
    assert standby is not None and standby["leading"] is False and standby["leader"] == url_a
    request = urllib.request.Request(
        f"{url_b}/v1/nodes", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=2)
    assert refused.value.code == 503 and refused.value.headers["X-Phalanx-Leader"] == url_a
    assert url_a in json.loads(refused.value.read())["error"]
    # A browser asking the standby for the dashboard is redirected to the leader's.
    for method in ("GET", "HEAD"):
        page = http.client.HTTPConnection("127.0.0.1", int(url_b.rsplit(":", 1)[1]), timeout=2)
        page.request(method, "/ui/")
        answer = page.getresponse()
        assert answer.status == 307 and answer.headers["Location"] == f"{url_a}/ui/", method
        page.close()
    # A client that knows only the standby is sent on to the leader.
    assert Client(url_b, TOKEN, timeout=2).get("/v1/nodes") == []
    fleet.start_nodes(2)  # through the client: B first, then A, which answers

    job = submit(fleet, "ha")
    fleet.wait_job(job, "running", timeout=60)
    before = wait_for(lambda: committed_step(fleet, job, 20, tier="ram"), 90, "step 20")
    generation = fleet.job(job)["generation"]
    first = term_of(url_a)

    a.kill9()
    killed = time.monotonic()
    took_over(b, url_b, first)
    took = time.monotonic() - killed
    # The ranks never stopped: the same generation, no restart, and the steps they
    # saved while no supervisor led are committed by the new leader, every one of them.
    after = wait_for(
        lambda: committed_step(fleet, job, before + 40, tier="ram"), 60, "commits under B"
    )
    steps = committed_steps(fleet, job, "ram")
    assert set(range(before, after + 1, 10)) <= steps, (before, after, sorted(steps))
    view = fleet.job(job)
    assert view["generation"] == generation and view["restarts"] == 0, view
    assert fleet.agents["n01"].alive() and fleet.agents["n02"].alive()

    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert done["restarts"] == 0
    assert final_digest(fleet, done) == undisturbed_digest()
    print(json.dumps({"takeover_s": round(took, 2)}))


def test_a_paused_leader_is_replaced_refused_by_term_and_steps_down(
    fleet: Fleet, pg_cluster: PgCluster
) -> None:
    a, b, url_a, url_b, job, _step = training(fleet, pg_cluster, "paused")

    first = term_of(url_a)
    a.signal(signal.SIGSTOP)
    try:
        term = took_over(b, url_b, first)
        # The agents learn the new term from B (its status, catalogs, commands) ...
        wait_for(
            lambda: f"leadership term {term} " in fleet.agents["n01"].output() or None,
            30,
            "n01 to see B's term",
        )
        # ... and refuse an order of the old one, as they would A's once it runs again.
        watcher = RawMqtt(fleet.broker.port)
        watcher.subscribe(wire.ack_topic("n01"))
        stale = wire.Command.new("n01", wire.PingArgs(), ttl=30, term=first)
        watcher.publish(wire.command_topic("n01"), wire.encode(stale))

        def refused() -> wire.CommandAck | None:
            for payload in watcher.received(wire.ack_topic("n01")):
                ack = wire.CommandAck.model_validate_json(payload)
                if ack.id == stale.id:
                    return ack
            return None

        ack = wait_for(refused, 20, "the stale command's ack")
        watcher.close()
        assert ack.status is wire.AckStatus.FAILED and f"term {first} " in ack.detail, ack
    finally:
        a.signal(signal.SIGCONT)
    # A runs again, finds its lease over, and steps down by itself, having sent nothing.
    wait_for(lambda: not a.alive() or None, 30, "the old leader to step down")
    assert a.proc is not None and a.proc.returncode == 3
    assert "no longer leads" in a.output(), a.output()[-2000:]
    assert leader_of(url_a) is None and term_of(url_b) == term

    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert done["restarts"] == 0
    assert final_digest(fleet, done) == undisturbed_digest()


def test_the_standby_finishes_a_recovery_the_killed_leader_began(
    fleet: Fleet, pg_cluster: PgCluster
) -> None:
    a, b, url_a, url_b, job, _step = training(fleet, pg_cluster, "recovering")
    first = term_of(url_a)

    os.kill(wait_for(lambda: rank_pid(job, 1), 10, "rank 1's process"), signal.SIGKILL)
    wait_for(
        lambda: fleet.job(job)["state"] in ("recovering", "starting") or None,
        30,
        "the recovery to start",
    )
    a.kill9()
    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert done["restarts"] >= 1
    assert final_digest(fleet, done) == undisturbed_digest()
    took_over(b, url_b, first)


def test_both_supervisors_ride_out_a_restart_of_postgresql(
    fleet: Fleet, pg_cluster: PgCluster
) -> None:
    a, b, url_a, url_b, job, before = training(fleet, pg_cluster, "pg-restart")
    first = term_of(url_a)

    pg_cluster.restart()
    # The leader took its lock again within its lease, on the same term; the standby
    # still stands by; the job trains on and its commits go on.
    wait_for(lambda: committed_step(fleet, job, before + 30, tier="ram"), 60, "commits after")
    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert done["restarts"] == 0
    assert a.alive() and b.alive()
    assert term_of(url_a) == first
    assert (leader_of(url_b) or {}).get("leading") is False
    assert "taken again on a new session" in a.output(), a.output()[-3000:]
