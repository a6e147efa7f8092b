"""The web dashboard in a real browser (Debian's chromium, headless, driven by selenium)
against a real fleet running a real tinylm job that recovers once.

Screenshots of every page are left in the test's ``tmp_path/screens`` to look at.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from phalanx.client import Client
from phalanx.jobspec import validate_spec
from phalanx.simgpu import inject
from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.jobs import JobState
from supervisor.records import Incident
from tests.harness import TOKEN, Fleet, wait_for
from tests.integration.training import TIERS, committed_step, tinylm
from tests.unit.supervisor.fake_fleet import birth
from tests.unit.supervisor.test_dashboard_auth import TOKEN as FAKE_TOKEN

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The supervisor's training metrics (GET /v1/jobs/ID/metrics), where this tree has them.
METRICS = "metrics_interval_s" in SupervisorSettings.model_fields
STEPS = ["--steps", "150", "--ckpt-every", "10", "--step-sleep", "0.04"]

try:
    from selenium import webdriver
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.chrome.webdriver import WebDriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:  # the dev extra installs it
    pytest.skip(
        "the dashboard's browser test needs selenium (pip install selenium)",
        allow_module_level=True,
    )


def read_all(browser: WebDriver, css: str, what: str = "textContent") -> list[str]:
    """``what`` (a property, or ``data-*`` through ``dataset``) of every element matching
    ``css``, read in one script: the page re-renders as it polls, so elements found by
    one WebDriver call may be gone (stale) by the next."""
    return list(
        browser.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0]), (e) => "
            "arguments[1].startsWith('data-') ? e.getAttribute(arguments[1]) : e[arguments[1]])",
            css,
            what,
        )
    )


def click(browser: WebDriver, css: str, what: str) -> None:
    """Click the element matching ``css``, found again if a re-render replaced it."""

    def once() -> bool:
        try:
            browser.find_element(By.CSS_SELECTOR, css).click()
        except StaleElementReferenceException:
            return False
        return True

    wait_for(once, 10, what)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        raise RuntimeError(
            f"the dashboard test needs {', '.join(missing)}: "
            "apt-get install -y chromium chromium-driver"
        )
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1400,1000",
        f"--user-data-dir={tmp_path / 'chromium'}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Both paths given: Selenium Manager downloads nothing.
    service = Service(executable_path=str(CHROMEDRIVER), log_output=str(tmp_path / "driver.log"))
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_script_timeout(10)
    yield driver
    driver.quit()


class Dashboard:
    """The dashboard of ``fleet`` in ``browser``: pages by route, waits, screenshots."""

    def __init__(self, fleet: Fleet, browser: WebDriver, screens: Path) -> None:
        self.fleet = fleet
        self.browser = browser
        self.screens = screens
        screens.mkdir(parents=True, exist_ok=True)
        self.url = f"http://127.0.0.1:{fleet.api_port}/ui/"

    def open(self, route: str = "") -> None:
        self.browser.get(self.url + route)

    def go(self, route: str) -> None:
        self.browser.execute_script("location.hash = arguments[0]", route)

    def page(self) -> Any:
        return self.browser.execute_script("return window.phalanx && window.phalanx.page")

    def js(self, script: str, *args: Any) -> Any:
        return self.browser.execute_script(script, *args)

    # Both read the page in one script: a page that re-renders between finding an element
    # and reading it cannot hand back a stale element.
    def texts(self, css: str) -> list[str]:
        found = self.js(
            "return Array.from(document.querySelectorAll(arguments[0]), e => e.innerText)", css
        )
        return [str(t).strip() for t in found]

    def attrs(self, css: str, name: str) -> list[str]:
        found = self.js(
            "return Array.from(document.querySelectorAll(arguments[0]),"
            " e => String(e.getAttribute(arguments[1])))",
            css,
            name,
        )
        return [str(a) for a in found]

    def wait(self, check: Any, what: str, timeout: float = 20) -> Any:
        return wait_for(check, timeout, what, interval=0.2)

    def login(self, token: str) -> None:
        self.wait(lambda: self.page() == "login" or None, "the login form")
        self.browser.find_element(By.ID, "token").send_keys(token)
        self.browser.find_element(By.ID, "login-submit").click()

    def shot(self, name: str) -> Path:
        """A screenshot of the whole page (the window grown to its height)."""
        path = self.screens / f"{name}.png"
        size = self.browser.get_window_size()
        height = self.js("return document.documentElement.scrollHeight")
        self.browser.set_window_size(size["width"], min(max(height + 120, size["height"]), 5000))
        try:
            self.browser.save_screenshot(str(path))
        finally:
            self.browser.set_window_size(size["width"], size["height"])
        return path

    def errors(self) -> list[str]:
        """Severe console messages (script errors, refused by the content security policy,
        failed requests) but the 401 of the first look before logging in, and where the
        supervisor has no metrics endpoint, its 404s."""
        expected = ["status of 401"] + ([] if METRICS else ["/metrics? - Failed to load"])
        return [
            str(e["message"])
            for e in self.browser.get_log("browser")
            if e["level"] == "SEVERE" and not any(x in e["message"] for x in expected)
        ]


def start(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    extra = ""
    if METRICS:  # a point a second, not every 5 s: a short job draws a curve
        extra = "metrics_interval_s = 1.0\n"
        monkeypatch.setenv("PHALANX_AGENTD_METRICS_INTERVAL_S", "1.0")
    fleet.start_supervisor(spares=1, extra=extra)
    fleet.start_nodes(3, racks=2)


def submit(fleet: Fleet, name: str, *extra: str, nodes: int = 2, seed: int = 0) -> str:
    job = fleet.submit(
        name=name,
        code_ref={"commit": "0a1b2c3", "source": "https://example.org/tinylm.git"},
        data_snapshot="tiny-2026-11",
        hyperparams={"seed": seed, "dim": 16},
        nodes=nodes,
        ranks_per_node=2,
        workdir=str(Path(__file__).resolve().parents[2]),
        command=tinylm(*STEPS, *extra),
        grace_period=5,
        env={"OMP_NUM_THREADS": "1"},
        checkpoint={"tiers": TIERS, "interval": {"steps": 10}},
    )
    return str(job["id"])


def test_the_dashboard_shows_the_fleet_the_jobs_and_a_recovered_jobs_story(
    fleet: Fleet, browser: WebDriver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    start(fleet, monkeypatch)
    ui = Dashboard(fleet, browser, tmp_path / "screens")
    job = submit(fleet, "tinylm-dash")

    ui.open("#/fleet")
    ui.login(TOKEN)

    # Fleet: every node the API knows, as a row of its rack and a tile.
    api_nodes = {n["id"]: n for n in fleet.client().get("/v1/nodes")}
    ui.wait(
        lambda: set(ui.attrs("tr.node", "data-node")) == set(api_nodes) or None,
        "every node on the fleet page",
    )
    assert sorted(ui.attrs(".tile", "data-node")) == sorted(api_nodes)
    assert set(ui.attrs("section.rack", "data-rack")) == {"rack1", "rack2"}
    spare_rows = ui.texts("tr.node .chip.spare")
    assert len(spare_rows) == sum(n["spare"] for n in api_nodes.values()) == 1
    ui.wait(lambda: "°C" in " ".join(ui.attrs(".tile", "title")) or None, "GPU temperatures")
    ui.shot("fleet")

    # Jobs: the job, running (its step committed at every tier: the moment to fail it).
    running = fleet.wait_job(job, "running", timeout=60)
    ui.go("#/jobs")
    ui.wait(lambda: job in ui.attrs("#running a.job-link", "data-job") or None, "the job running")
    ui.shot("jobs")
    wait_for(lambda: committed_step(fleet, job, 20), 90, "step 20 committed at every tier")
    victim = running["nodes"][1]
    inject(fleet.sim_file(victim), 0, "ecc-dbe")  # drained; the spare takes its ranks
    done = fleet.wait_job(job, "succeeded", timeout=180)
    ui.wait(lambda: job in ui.attrs("#finished a.job-link", "data-job") or None, "the job done")

    # The fleet again: the victim drained, why, and its GPU's double-bit ECC error.
    ui.go("#/fleet")
    row = ui.wait(
        lambda: ui.texts(f'tr.node.state-drain[data-node="{victim}"]') or None, "the victim"
    )[0]
    assert "ecc_dbe" in row
    assert fleet.node(victim)["gauges"]["ecc_dbe_volatile"] >= 1
    assert f"/ {fleet.node(victim)['gauges']['ecc_dbe_volatile']}" in row  # ECC SBE / DBE
    ui.shot("fleet-after")

    # The queue: a job too big for the fleet waits, and says why ...
    big = fleet.submit(name="too-big", nodes=8, ranks_per_node=1, command=["true"])["id"]
    waiting = wait_for(lambda: fleet.job(big)["waiting"], 10, "the big job's wait reason")
    ui.go("#/jobs")
    queued = ui.wait(lambda: ui.texts(f'#queue tr[data-job="{big}"]') or None, "the queue")
    assert waiting["reason"] in queued[0]
    ui.shot("jobs-queue")
    # ... until its page cancels it (a POST by the session cookie, with the CSRF header).
    ui.go(f"#/jobs/{big}")
    ui.wait(lambda: ui.browser.find_elements(By.ID, "cancel") or None, "cancel button")
    click(ui.browser, "#cancel", "the cancel button")
    ui.browser.switch_to.alert.accept()
    fleet.wait_job(big, "cancelled", timeout=10)

    # The job: its two generations, the recovery between them, its checkpoints, its log.
    ui.go(f"#/jobs/{job}")
    ui.wait(lambda: len(ui.texts("#generations tr.generation")) == 2 or None, "2 generations")
    (incident,) = done["incidents"]
    failed_generation = ui.texts('#generations tr.generation[data-generation="1"]')[0]
    assert incident["plan"]["action"] in failed_generation
    assert incident["failures"][0]["kind"] in failed_generation
    assert f"restored step {incident['restored_step']}" in failed_generation
    size = incident["size"]
    assert f"{size['nodes']} nodes, {size['world_size']} ranks" in failed_generation
    assert len(ui.browser.find_elements(By.CSS_SELECTOR, "#generations .phases .phase")) >= 4
    catalog = fleet.client().get(f"/v1/jobs/{job}/checkpoints")
    newest = max((s for s in catalog["steps"] if s["committed"]), key=lambda s: s["step"])
    ui.wait(lambda: str(newest["step"]) in ui.attrs("tr.ckpt", "data-step") or None, "checkpoints")
    row = ui.texts(f'tr.ckpt[data-step="{newest["step"]}"]')[0]
    assert row.count("✓") == len(newest["committed"])  # one a tier it is committed at
    if newest.get("loss") is not None:  # the step's loss, where the supervisor knows it
        assert "loss" in ui.texts("#checkpoints thead")[0]
        assert f"{newest['loss']:.3}"[:3] in row
    assert "0a1b2c3" in ui.texts("section.card dl.kv")[0]  # the spec's code
    assert "%" in ui.texts("#goodput")[0]
    ui.wait(lambda: '"digest"' in ui.texts("#log")[0] or None, "rank 0's log to its last line")
    ui.js(
        "const r = document.getElementById('log-rank'); r.value = 2;"
        "r.dispatchEvent(new Event('change'))"
    )
    ui.wait(lambda: '"rank": 2' in ui.texts("#log")[0] or None, "rank 2's log")
    if METRICS:
        api = fleet.client().get(f"/v1/jobs/{job}/metrics")
        assert api["series"]["loss"], "the supervisor kept no loss"

        seen: dict[str, Any] = {}

        def chart_matches() -> bool | None:
            seen["page"] = ui.js("return window.phalanx.metrics.loss || []")
            seen["chart"] = ui.js("return window.phalanx.charts.loss")
            seen["api"] = fleet.client().get(f"/v1/jobs/{job}/metrics?names=loss")["series"]["loss"]
            points = seen["api"]
            values = [p[2] if isinstance(p[2], float | int) else None for p in points]
            chart = seen["chart"]
            return (
                seen["page"] == points
                and chart["x"] == [p[1] for p in points]
                and chart["y"] == [values]
            ) or None

        try:
            ui.wait(chart_matches, "the loss chart to hold the API's loss series", timeout=30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{json.dumps(seen, indent=None)}") from None
    else:
        ui.wait(lambda: "No metrics yet" in ui.texts("#chart-note")[0] or None, "no metrics")
    ui.shot("job")

    # Compare: the job beside a second run, by step (on one node: the victim is drained
    # and the other healthy one held back as the spare).
    second = submit(fleet, "tinylm-dash-seed1", "--seed", "1", nodes=1, seed=1)
    fleet.wait_job(second, "succeeded", timeout=120)
    ui.go(f"#/compare?jobs={job},{second}")
    ui.wait(lambda: len(ui.texts("#lineage thead th")) == 3 or None, "the lineage of both jobs")
    lineage = ui.texts("#lineage")[0]
    assert "tinylm-dash" in lineage and "tinylm-dash-seed1" in lineage
    assert "OMP_NUM_THREADS" in lineage
    assert "0a1b2c3 from https://example.org/tinylm.git" in lineage
    assert "tiny-2026-11" in lineage
    differs = ui.texts("#lineage tr.differs th")
    assert "hyperparam seed" in differs and "hyperparam dim" not in differs
    if METRICS:
        ui.wait(
            lambda: (
                all(
                    any(v is not None for v in ys)
                    for ys in ui.js("return (window.phalanx.charts.compare || {y: [[]]}).y")
                )
                or None
            ),
            "both jobs' loss on the compare chart",
        )
    else:
        ui.wait(lambda: "No metrics yet" in ui.texts("#compare-note")[0] or None, "no metrics")
    ui.shot("compare")

    # Events: the job's own, then one node's.
    ui.go(f"#/events?job={job}")
    ui.wait(lambda: "job_recovered" in ui.attrs("tr.event", "data-kind") or None, "job events")
    ui.browser.find_element(By.ID, "events-kind").send_keys("-ckpt")
    kinds = ui.wait(lambda: ui.attrs("tr.event", "data-kind") or None, "the kinds left")
    assert "job_recovered" in kinds and not any(k.startswith("ckpt") for k in kinds)
    ui.shot("events")
    ui.go("#/events?node=n01")
    ui.wait(lambda: ui.texts("tr.event") or None, "n01's events")
    nodes_shown = set(ui.texts("tr.event > td:nth-child(4)"))
    assert nodes_shown == {"n01"}

    errors = ui.errors()
    assert errors == [], "\n".join(errors)


def test_a_wrong_token_is_refused_and_the_page_shows_no_data(
    fleet: Fleet, browser: WebDriver, tmp_path: Path
) -> None:
    fleet.start_supervisor()
    ui = Dashboard(fleet, browser, tmp_path / "screens")
    ui.open("#/fleet")

    ui.login("not-the-token")

    ui.wait(lambda: "Wrong token" in ui.texts("#login-error")[0] or None, "the refusal")
    assert ui.page() == "login"
    assert ui.browser.get_cookies() == []
    ui.shot("login-refused")


def test_a_login_keeps_a_cookie_no_script_reads_and_a_logout_forgets_it(
    fleet: Fleet, browser: WebDriver, tmp_path: Path
) -> None:
    fleet.start_supervisor()
    ui = Dashboard(fleet, browser, tmp_path / "screens")
    ui.open("#/fleet")
    ui.login(TOKEN)
    ui.wait(lambda: ui.page() == "fleet" or None, "the fleet page")
    ui.wait(lambda: "No node" in ui.texts("#racks")[0] or None, "an empty fleet")
    (cookie,) = browser.get_cookies()
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert TOKEN not in cookie["value"]
    assert ui.js("return document.cookie") == ""  # no script of the page can read it
    ui.open("#/jobs")  # a reload: the session holds
    ui.wait(lambda: ui.page() == "jobs" or None, "the jobs page without a login")

    browser.find_element(By.ID, "logout").click()

    ui.wait(lambda: ui.page() == "login" or None, "the login form")
    assert browser.get_cookies() == []
    ui.open("#/fleet")
    ui.wait(lambda: ui.page() == "login" or None, "the login form after a reload")


def test_a_viewers_session_is_refused_a_cancel_and_ends_when_its_token_is_revoked(
    fleet: Fleet, browser: WebDriver, tmp_path: Path
) -> None:
    fleet.start_supervisor()
    admin = fleet.client()
    viewer = admin.post("/v1/tokens", {"role": "viewer", "name": "wall"})
    job = fleet.submit(name="waits", nodes=1, ranks_per_node=1, command=["true"])["id"]
    ui = Dashboard(fleet, browser, tmp_path / "screens")
    ui.open(f"#/jobs/{job}")
    ui.login(viewer["secret"])
    ui.wait(lambda: "wall (viewer)" in ui.texts("#who")[0] or None, "who is logged in")

    ui.wait(lambda: ui.browser.find_elements(By.ID, "cancel") or None, "cancel button")
    click(ui.browser, "#cancel", "the cancel button")
    ui.browser.switch_to.alert.accept()

    refused = ui.wait(
        lambda: [t for t in ui.texts("p.error") if "cannot cancel" in t] or None, "the 403"
    )
    assert refused[0] == (
        f"token 'wall' (viewer) cannot cancel job {job} of team research: needs role "
        "operator, or member of team research"
    )
    assert fleet.job(job)["state"] == "pending"
    ui.shot("viewer-refused")

    admin.post(f"/v1/tokens/{viewer['id']}/revoke")

    ended = ui.wait(
        lambda: (ui.page() == "login" and ui.texts("#login-error")[0]) or None, "the login form"
    )
    assert f"token {viewer['id']} was revoked at" in ended
    ui.shot("session-revoked")


@pytest.fixture
def big_fleet(tmp_path: Path) -> Iterator[str]:
    """The real supervisor's API app (the supervisor built, never started: no broker)
    over a registry of 2,048 nodes of 8 GPUs in 64 racks, births straight into it,
    served from a thread; yields its base URL."""
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path, offline_after_s=3600.0), FAKE_TOKEN)
    for i in range(2048):
        sup.registry.on_birth(birth(f"n{i:04d}", rack=f"r{i // 32:02d}", gpus=8))
    for i in range(0, 2048, 97):
        sup.registry.drain(f"n{i:04d}", "cable swap")
    with serve_unstarted(sup) as url:
        yield url


@contextlib.contextmanager
def serve_unstarted(sup: Supervisor) -> Iterator[str]:
    """The API app of ``sup`` (built, never started) served from a thread; its base URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner = web.AppRunner(make_app(sup))
    asyncio.run_coroutine_threadsafe(runner.setup(), loop).result(10)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    asyncio.run_coroutine_threadsafe(site.start(), loop).result(10)
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        sup.store.close()


def test_the_fleet_page_of_2048_nodes_shows_every_node_as_a_tile_and_no_table_of_them_all(
    big_fleet: str, browser: WebDriver, tmp_path: Path
) -> None:
    browser.get(f"{big_fleet}/ui/#/fleet")
    screens = tmp_path / "screens"
    screens.mkdir()
    wait_for(lambda: browser.find_elements(By.ID, "token") or None, 20, "the login form")
    browser.find_element(By.ID, "token").send_keys(FAKE_TOKEN)
    browser.find_element(By.ID, "login-submit").click()

    tiles = wait_for(
        lambda: len(browser.find_elements(By.CSS_SELECTOR, ".tile")) == 2048 or None,
        30,
        "a tile for each of the 2,048 nodes",
    )
    assert tiles
    assert len(browser.find_elements(By.CSS_SELECTOR, "section.rack")) == 64
    assert browser.find_elements(By.CSS_SELECTOR, "tr.node") == []  # every rack closed
    assert len(browser.find_elements(By.CSS_SELECTOR, ".tile.state-drain")) == 22
    assert "2,048 nodes" in browser.find_element(By.ID, "fleet-summary").text
    browser.save_screenshot(str(screens / "fleet-2048.png"))

    # The page re-renders as it polls: what is read is read in one script, and a click
    # finds its element again if a re-render replaced it.
    browser.find_element(By.ID, "fleet-filter").send_keys("n0194")
    wait_for(lambda: read_all(browser, "tr.node") or None, 10, "the node found")
    assert read_all(browser, "tr.node", "data-node") == ["n0194"]
    assert "cable swap" in read_all(browser, "tr.node")[0]

    browser.find_element(By.ID, "fleet-filter").send_keys(Keys.CONTROL, "a", Keys.BACKSPACE)
    click(browser, '[data-rack="r03"] .rack-toggle', "rack r03 opened")
    rows = wait_for(
        lambda: (r := read_all(browser, "tr.node", "data-node")) and len(r) == 32 and r,
        10,
        "rack r03's 32 rows",
    )
    assert set(rows) == {f"n{i:04d}" for i in range(96, 128)}
    click(browser, 'tr.node[data-node="n0097"] button', "n0097's details opened")
    gpus = wait_for(
        lambda: read_all(browser, "tr.detail table.inner tbody tr") or None, 10, "n0097's GPUs"
    )
    assert len(gpus) == 8
    assert "57.5" in gpus[1]
    browser.save_screenshot(str(screens / "fleet-2048-rack.png"))


def login(browser: WebDriver, url: str, route: str) -> None:
    browser.get(f"{url}/ui/{route}")
    wait_for(lambda: browser.find_elements(By.ID, "token") or None, 20, "the login form")
    browser.find_element(By.ID, "token").send_keys(FAKE_TOKEN)
    browser.find_element(By.ID, "login-submit").click()


def test_the_jobs_page_pages_the_finished_jobs_on_the_server_newest_first(
    browser: WebDriver, tmp_path: Path
) -> None:
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path), FAKE_TOKEN)

    # Read and click in one script each: the page redraws every poll, so an element
    # found by one call may be gone by the next.
    def shown(css: str = "#finished a.job-link") -> list[str]:
        jobs: list[str] = browser.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map((e) => e.dataset.job)", css
        )
        return jobs

    def turn(to: str) -> None:
        browser.execute_script(
            "[...document.querySelectorAll('.pager button')]"
            ".find((b) => b.textContent.includes(arguments[0])).click()",
            to,
        )

    with serve_unstarted(sup) as url:
        client = Client(url, FAKE_TOKEN)
        spec = {"team": "ml", "command": ["true"], "workdir": "/w", "nodes": 1, "ranks_per_node": 1}
        ids = [
            client.post("/v1/jobs", {"spec": {**spec, "name": f"run{i}"}})["id"] for i in range(60)
        ]
        for job in ids[:55]:
            client.post(f"/v1/jobs/{job}/cancel")
        everything = client.get("/v1/jobs")
        newest_first = [j["id"] for j in sorted(everything, key=lambda j: -j["submitted_at"])]
        finished = [j for j in newest_first if j in ids[:55]]

        login(browser, url, "#/jobs")
        wait_for(lambda: shown() == finished[:25] or None, 20, "the newest 25 finished jobs")
        assert set(shown("#queue tr[data-job]")) == set(ids[55:])
        assert "page 1 of 3 (55)" in browser.execute_script(
            "return document.querySelector('.pager').textContent"
        )
        turn("next")
        wait_for(lambda: shown() == finished[25:50] or None, 10, "the second page")
        turn("next")
        wait_for(lambda: shown() == finished[50:] or None, 10, "the last page")
        browser.save_screenshot(str(tmp_path / "jobs-page-3.png"))
        turn("prev")
        wait_for(lambda: shown() == finished[25:50] or None, 10, "the second page again")


def test_the_job_page_of_a_script_without_steps_shows_its_lost_work_unknown_and_ettr_a_bound(
    tmp_path: Path, browser: WebDriver
) -> None:
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path, offline_after_s=3600.0), FAKE_TOKEN)
    sup.registry.on_birth(birth("n01"))
    job = sup.jobs.submit(
        validate_spec(
            {
                "name": "plain",
                "team": "research",
                "command": ["python", "train.py"],
                "workdir": "/srv",
                "nodes": 1,
                "ranks_per_node": 1,
            }
        )
    )
    now = time.time()
    job.state, job.generation, job.nodes = JobState.RUNNING, 2, ["n01"]
    job.first_started_at, job.started_at = now - 400.0, now - 100.0
    job.incidents = [
        Incident.from_record(
            {
                "generation": 1,
                "next_generation": 2,
                "failures": [{"kind": "rank_exit", "node": "n01", "rank": 0, "signal": 9}],
                "plan": {"action": "restart_in_place", "reason": "rank 0 was killed"},
                "phases": {"detect": 0.01, "plan": 0.001, "stop": 0.1},
                "outcome": "recovered",
                "failed_step": None,
                "restored_step": None,
                "lost_steps": None,
                "lost_work_s": None,
                "downtime_s": 2.0,
                "acked_s": 2.0,
                "mttr_s": None,
                "resumed_at": now - 100.0,
            }
        )
    ]
    sup.jobs.save(job)
    with serve_unstarted(sup) as url:
        browser.get(f"{url}/ui/#/jobs/{job.id}")
        wait_for(lambda: browser.find_elements(By.ID, "token") or None, 20, "the login form")
        browser.find_element(By.ID, "token").send_keys(FAKE_TOKEN)
        browser.find_element(By.ID, "login-submit").click()
        goodput = wait_for(
            lambda: (e := read_all(browser, "#goodput", "innerText")) and e[0], 20, "goodput"
        )
        row = read_all(browser, 'tr.generation[data-generation="1"]', "innerText")[0]

    assert "≤" in goodput and "upper bound" in goodput and "unknown" in goodput
    assert "unknown" in row  # its work lost, not 0 s
