"""The web dashboard in a real browser (Debian's chromium, headless, driven by selenium)
against a real fleet running a real tinylm job that recovers once.

Screenshots of every page are left in the test's ``tmp_path/screens`` to look at.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import SupervisorSettings
from tests.harness import TOKEN, Fleet, rank_pid, wait_for
from tests.integration.test_recovery_training import TIERS, committed_step, tinylm

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The supervisor's training metrics (GET /v1/jobs/ID/metrics), where this tree has them.
METRICS = "metrics_interval_s" in SupervisorSettings.model_fields
STEPS = ["--steps", "150", "--ckpt-every", "10", "--step-sleep", "0.04"]

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.chrome.webdriver import WebDriver
    from selenium.webdriver.common.by import By
except ImportError:  # the dev extra installs it
    pytest.skip(
        "the dashboard's browser test needs selenium (pip install selenium)",
        allow_module_level=True,
    )


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

    def texts(self, css: str) -> list[str]:
        return [e.text for e in self.browser.find_elements(By.CSS_SELECTOR, css)]

    def attrs(self, css: str, name: str) -> list[str]:
        return [
            str(e.get_attribute(name)) for e in self.browser.find_elements(By.CSS_SELECTOR, css)
        ]

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
    for i in range(3):
        fleet.start_agent(f"n{i + 1:02d}", rack=f"rack{i % 2 + 1}")
    for i in range(3):
        fleet.wait_state(f"n{i + 1:02d}", "up")


def submit(fleet: Fleet, name: str, *extra: str) -> str:
    job = fleet.submit(
        name=name,
        nodes=2,
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
    fleet.wait_job(job, "running", timeout=60)
    ui.go("#/jobs")
    ui.wait(lambda: job in ui.attrs("#running a.job-link", "data-job") or None, "the job running")
    ui.shot("jobs")
    wait_for(lambda: committed_step(fleet, job, 20), 90, "step 20 committed at every tier")
    os.kill(wait_for(lambda: rank_pid(job, 3), 10, "rank 3"), signal.SIGKILL)
    done = fleet.wait_job(job, "succeeded", timeout=180)
    ui.wait(lambda: job in ui.attrs("#finished a.job-link", "data-job") or None, "the job done")

    # The job: its two generations, the recovery between them, its checkpoints, its log.
    ui.go(f"#/jobs/{job}")
    ui.wait(lambda: len(ui.texts("#generations tr.generation")) == 2 or None, "2 generations")
    (incident,) = done["incidents"]
    failed_generation = ui.texts('#generations tr.generation[data-generation="1"]')[0]
    assert incident["plan"]["action"] in failed_generation
    assert incident["failures"][0]["kind"] in failed_generation
    assert f"restored step {incident['restored_step']}" in failed_generation
    assert len(ui.browser.find_elements(By.CSS_SELECTOR, "#generations .phases .phase")) >= 4
    catalog = fleet.client().get(f"/v1/jobs/{job}/checkpoints")
    newest = max((s for s in catalog["steps"] if s["committed"]), key=lambda s: s["step"])
    ui.wait(lambda: str(newest["step"]) in ui.attrs("tr.ckpt", "data-step") or None, "checkpoints")
    row = ui.texts(f'tr.ckpt[data-step="{newest["step"]}"]')[0]
    assert row.count("✓") == len(newest["committed"])  # one a tier it is committed at
    assert "%" in ui.texts("#goodput")[0]
    ui.wait(lambda: '"digest"' in ui.texts("#log")[0] or None, "rank 0's log to its last line")
    if METRICS:
        api = fleet.client().get(f"/v1/jobs/{job}/metrics")
        assert api["series"]["loss"], "the supervisor kept no loss"

        def chart_matches() -> bool | None:
            shown = ui.js("return window.phalanx.metrics.loss || []")
            chart = ui.js("return window.phalanx.charts.loss")
            points = fleet.client().get(f"/v1/jobs/{job}/metrics?names=loss")["series"]["loss"]
            values = [p[2] if isinstance(p[2], float | int) else None for p in points]
            return (
                shown == points and chart["x"] == [p[1] for p in points] and chart["y"] == [values]
            ) or None

        ui.wait(chart_matches, "the loss chart to hold the API's loss series", timeout=30)
    else:
        ui.wait(lambda: "No metrics yet" in ui.texts("#chart-note")[0] or None, "no metrics")
    ui.shot("job")

    # Compare: the job beside a second run of the same command, by step.
    second = submit(fleet, "tinylm-dash-seed1", "--seed", "1")
    fleet.wait_job(second, "succeeded", timeout=120)
    ui.go(f"#/compare?jobs={job},{second}")
    ui.wait(lambda: len(ui.texts("#lineage thead th")) == 3 or None, "the lineage of both jobs")
    lineage = ui.texts("#lineage")[0]
    assert "tinylm-dash" in lineage and "tinylm-dash-seed1" in lineage
    assert "OMP_NUM_THREADS" in lineage
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
    ui.shot("compare")

    # Events: the job's own, then one node's.
    ui.go(f"#/events?job={job}")
    ui.wait(lambda: "job_recovered" in ui.attrs("tr.event", "data-kind") or None, "job events")
    ui.shot("events")
    ui.go("#/events?node=n01")
    ui.wait(lambda: ui.texts("tr.event") or None, "n01's events")
    nodes_shown = {
        e.find_elements(By.CSS_SELECTOR, "td")[3].text
        for e in ui.browser.find_elements(By.CSS_SELECTOR, "tr.event")
    }
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
