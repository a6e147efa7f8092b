"""A real job's training metrics, from rank 0's ``phalanx.rank.step`` to the API and the CLI."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from phalanx import wire
from phalanx.client import ApiError
from tests.harness import TOKEN, Fleet, RawMqtt, wait_for
from tests.tinylm import REPO, tinylm

pytestmark = pytest.mark.integration

STEPS = 120
FAST = "metrics_interval_s = 0.5\n"


def two_nodes(fleet: Fleet) -> None:
    fleet.start_supervisor(extra=FAST)
    fleet.start_nodes(2, top=FAST)


def rank0_losses(fleet: Fleet, job: dict[str, Any]) -> dict[int, float]:
    """What rank 0 logged: its loss (rounded to 4 places) at every step."""
    node = next(r["node"] for r in job["ranks"] if r["rank"] == 0)
    log = fleet.root / "nodes" / node / "data" / "jobs" / job["id"] / "g1" / "rank-0.log"
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith('{"step"')]
    return {line["step"]: line["loss"] for line in lines}


def test_a_jobs_loss_series_is_what_rank_0_logged_and_phalanx_metrics_prints_it(
    fleet: Fleet,
) -> None:
    two_nodes(fleet)
    job = fleet.run_job(
        name="seen",
        nodes=2,
        ranks_per_node=2,
        workdir=str(REPO),
        command=tinylm("--log-every", "1", "--steps", str(STEPS), "--step-sleep", "0.02"),
        env={"OMP_NUM_THREADS": "1"},
    )
    job_id = job["id"]

    def series() -> dict[str, Any] | None:
        got: dict[str, Any] = fleet.client().get(
            f"/v1/jobs/{job_id}/metrics?names=loss,tokens_per_s,grad_norm"
        )
        loss = got["series"]["loss"]
        return got if loss and loss[-1][0] == STEPS - 1 else None

    got = wait_for(series, 15, "the last step's loss in the series", interval=0.2)
    logged = rank0_losses(fleet, job)
    points = got["series"]["loss"]
    assert len(points) >= 3  # one a window of 0.5 s over a run of 120 x 20+ ms
    for step, _ts, value, low, high, n in points:
        assert abs(value - logged[step]) <= 5e-5 + 1e-12, (step, value, logged[step])
        assert low <= value <= high and n == 1
    assert [p[0] for p in points] == sorted({p[0] for p in points})
    assert all(p[2] > 0 for p in got["series"]["tokens_per_s"])
    assert all(math.isfinite(p[2]) and p[2] > 0 for p in got["series"]["grad_norm"])

    summary = fleet.job(job_id)["summary"]
    assert summary["step"] == STEPS - 1
    assert abs(summary["loss"] - logged[STEPS - 1]) <= 5e-5 + 1e-12
    assert summary["tokens_per_s"] > 0 and summary["step_time_s"] > 0.02
    # tinylm reports its FLOPs per step; a sim GPU is a "Simulated H100": a CPU's tiny share
    assert 0 < summary["mfu"] < 0.01

    shown = fleet.cli("metrics", job_id)
    assert shown.returncode == 0, shown.stderr
    loss_line = next(x for x in shown.stdout.splitlines() if x.startswith("loss "))
    _, last, step, _range, chart = loss_line.split()
    assert (float(last), int(step)) == (pytest.approx(logged[STEPS - 1], abs=1e-3), STEPS - 1)
    assert set(chart) <= set("▁▂▃▄▅▆▇█")
    assert any(x.startswith("tokens_per_s ") for x in shown.stdout.splitlines())
    as_json = json.loads(fleet.cli("metrics", job_id, "-o", "json").stdout)
    assert as_json["series"]["loss"] == points


def test_metrics_queries_name_their_bad_parameter_and_unknown_jobs_are_404(
    fleet: Fleet,
) -> None:
    fleet.start_supervisor()
    job = fleet.submit(name="idle", nodes=1, ranks_per_node=1, command=["true"])
    client = fleet.client()
    for query, param in (
        ("names=loss,bad%20name", "names"),
        ("since=yesterday", "since"),
        ("since=nan", "since"),
        ("step_from=-1", "step_from"),
    ):
        with pytest.raises(ApiError, match=f"'{param}'") as err:
            client.get(f"/v1/jobs/{job['id']}/metrics?{query}")
        assert err.value.status == 400
    with pytest.raises(ApiError, match="nope") as err:
        client.get("/v1/jobs/nope/metrics")
    assert err.value.status == 404
    assert client.get(f"/v1/jobs/{job['id']}/metrics")["series"] == {}


def test_the_supervisor_serves_prometheus_metrics_behind_its_token(fleet: Fleet) -> None:
    fleet.start_supervisor()
    url = f"http://127.0.0.1:{fleet.api_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=5)
    assert err.value.code == 401
    err.value.close()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        text = resp.read().decode()
    assert 'phalanx_jobs{state="running"} 0.0' in text
    assert "phalanx_recoveries_total 0.0" in text


def test_metrics_of_an_unknown_job_are_dropped_and_counted(fleet: Fleet) -> None:
    fleet.start_supervisor()
    batch = wire.MetricsBatch(
        node="n01",
        job="ghost-job",
        generation=1,
        window_s=5.0,
        sent_at=time.time(),
        ranks=[wire.RankWindow(rank=0, step_first=0, step_last=9, at=time.time(), reports=10)],
    )
    # The API listens before the supervisor has subscribed over MQTT, and a batch is not
    # retained: send it again until one is heard.
    raw = RawMqtt(fleet.broker.port)

    def dropped() -> bool:
        raw.publish(wire.metrics_topic("n01"), wire.encode(batch))
        time.sleep(0.5)
        return fleet.client().get("/v1/stats")["metrics_dropped"] >= 1

    try:
        wait_for(dropped, 20, "the supervisor to drop the batch")
    finally:
        raw.close()
    assert fleet.client().get("/v1/jobs") == []  # no job made of it
    assert fleet.supervisor is not None and fleet.supervisor.alive()
