"""The dashboard's sweep page in a real browser (headless chromium): the trials table,
the objective of each trial by step (a pruned one cut short) and each parameter against
the objective, matching ``GET /v1/sweeps/{id}``.

The real supervisor's app and sweeps (built, never started: no broker), served from a
thread; the trials' jobs are moved and their loss written as in
``tests/unit/supervisor/test_sweeps.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from phalanx.client import Client
from phalanx.sweepspec import validate_sweep
from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.jobs import JobState
from tests.harness import wait_for
from tests.integration.test_dashboard import browser  # noqa: F401  (a fixture)
from tests.unit.supervisor.test_sweeps import SWEEP, TOKEN, losses, run, settle, trial_jobs

pytestmark = pytest.mark.integration

try:
    from selenium.webdriver.chrome.webdriver import WebDriver
    from selenium.webdriver.common.by import By
except ImportError:  # the dev extra installs it
    pytest.skip("the sweep page's browser test needs selenium", allow_module_level=True)


async def a_sweep_with_every_kind_of_trial(sup: Supervisor) -> str:
    """Four trials at once: two complete, one pruned at step 10, one running."""
    spec = validate_sweep({**SWEEP, "n_trials": 4, "parallelism": 4})
    sw = sup.sweeps.submit(spec)
    sup.sweeps.tick()
    jobs = trial_jobs(sup, sw)
    for job in jobs:
        run(job)
    for job, values in (
        (jobs[0], {5: 2.0, 10: 1.0, 20: 0.8, 30: 0.6}),
        (jobs[1], {5: 2.6, 10: 2.5}),
        (jobs[2], {5: 1.8, 10: 0.9, 20: 0.7, 30: 0.5}),
        (jobs[3], {5: 1.9}),
    ):
        losses(sup, job, values)
        sup.sweeps.tick()
    for job in (jobs[0], jobs[2]):
        job.move(JobState.SUCCEEDED)
    sup.sweeps.tick()
    await settle(sup)
    return sw.id


@contextlib.contextmanager
def served(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The supervisor's app with one sweep, from a thread: its URL and the sweep's id."""
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path, offline_after_s=3600.0), TOKEN)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(make_app(sup))
    try:
        sweep = asyncio.run_coroutine_threadsafe(a_sweep_with_every_kind_of_trial(sup), loop)
        sweep_id = sweep.result(30)
        asyncio.run_coroutine_threadsafe(runner.setup(), loop).result(10)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        asyncio.run_coroutine_threadsafe(site.start(), loop).result(10)
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", sweep_id
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        sup.store.close()


def test_the_sweep_page_shows_the_trials_and_charts_matching_the_api(
    browser: WebDriver,  # noqa: F811
    tmp_path: Path,
) -> None:
    with served(tmp_path) as (url, sweep_id):
        api: dict[str, Any] = Client(url, TOKEN).get(f"/v1/sweeps/{sweep_id}")
        browser.get(f"{url}/ui/#/sweeps")
        wait_for(lambda: browser.find_elements(By.ID, "token") or None, 20, "the login form")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "login-submit").click()
        link = wait_for(
            lambda: (
                browser.find_elements(By.CSS_SELECTOR, f'a.sweep-link[data-sweep="{sweep_id}"]')
                or None
            ),
            20,
            "the sweep in the list",
        )
        link[0].click()

        def shown() -> dict[str, Any] | None:
            found: dict[str, Any] = browser.execute_script(
                "const c = window.phalanx.charts;"
                "return c['sweep-objective'] && c['sweep-param-lr'] && {"
                " rows: [...document.querySelectorAll('tr.trial')]"
                "   .map((r) => [Number(r.dataset.trial), r.dataset.state]),"
                " objective: c['sweep-objective'], lr: c['sweep-param-lr'],"
                " best: document.getElementById('sweep-best').textContent}"
            )
            return found if found and found["objective"]["x"][-1:] == [30] else None

        page = wait_for(shown, 20, "the sweep page with its charts")
        browser.save_screenshot(str(tmp_path / "sweep.png"))

        trials = {t["number"]: t for t in api["trials"]}
        assert sorted(page["rows"]) == sorted([n, t["state"]] for n, t in trials.items())
        assert [trials[n]["state"] for n in range(4)] == [
            "complete",
            "pruned",
            "complete",
            "running",
        ]
        assert page["best"].startswith(f"best: trial {api['best']['number']}, 0.5")
        objective = page["objective"]
        xs, ys = objective["x"], objective["y"]
        assert objective["labels"] == [f"trial {n}" for n in range(4)]
        assert [x for x, y in zip(xs, ys[1], strict=True) if y is not None] == [5, 10]  # cut short
        assert [x for x, y in zip(xs, ys[2], strict=True) if y is not None] == [5, 10, 20, 30]
        ended = sorted(
            (t["params"]["lr"], t["value"], t["state"])
            for t in trials.values()
            if t["state"] != "running"
        )
        assert page["lr"]["x"] == pytest.approx([lr for lr, _, _ in ended])
        assert page["lr"]["y"][0] == [v if s == "complete" else None for _, v, s in ended]
        assert page["lr"]["y"][1] == [v if s == "pruned" else None for _, v, s in ended]

        browser.find_element(By.CSS_SELECTOR, 'th[data-sort="value"]').click()
        first = wait_for(
            lambda: (
                browser.execute_script(
                    "const r = document.querySelector('tr.trial'); return r && r.dataset.trial"
                )
                == str(api["best"]["number"])
                or None
            ),
            10,
            "the best trial first once sorted by value",
        )
        assert first
        severe = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert [e["message"] for e in severe if "status of 401" not in e["message"]] == []
