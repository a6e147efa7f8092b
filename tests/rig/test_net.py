"""The rig's claims and sweeps without root: runs side by side get their own id and
subnet, and a sweep removes what dead runs left, never a live run's (``ip`` faked)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.rig import fleet, net
from tests.rig.net import RunState, claim_lock, claim_run, free_subnet, process_started


@pytest.fixture
def ip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, ...]]:
    """The rig's state in ``tmp_path``; every command it runs recorded, none run."""
    calls: list[tuple[str, ...]] = []

    def sh(
        *cmd: str, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(net, "STATE_ROOT", tmp_path / "rig")
    monkeypatch.setattr(net, "CLAIM_LOCK", tmp_path / "rig.lock")
    monkeypatch.setattr(net, "sh", sh)
    monkeypatch.setattr(fleet, "sh", sh)
    return calls


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_zombie_is_not_a_live_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    try:
        assert process_started(child.pid) is None  # exited, not yet reaped
    finally:
        child.wait()


def test_runs_claiming_at_once_each_get_their_own_id_and_subnet(ip: list[tuple[str, ...]]) -> None:
    claimed: list[RunState] = []

    def claim() -> None:
        # The same seed: every claimant tries the same id and subnet first.
        with claim_lock():
            claimed.append(claim_run(random.Random(7)))

    threads = [threading.Thread(target=claim) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(claimed) == 6
    assert len({s.rid for s in claimed}) == 6
    assert len({s.subnet for s in claimed}) == 6
    assert {d.name for d in net.STATE_ROOT.iterdir()} == {s.rid for s in claimed}
    assert all(s.owner == os.getpid() and s.owner_alive() for s in claimed)


def test_a_subnet_routed_here_or_claimed_by_a_run_is_not_picked() -> None:
    first = free_subnet("", set(), random.Random(3))
    routed = f"{first.network_address + 254} dev phx1234br proto kernel scope link"
    assert free_subnet(routed, set(), random.Random(3)) != first
    assert free_subnet("", {str(first)}, random.Random(3)) != first


def test_a_run_is_live_while_the_process_that_made_it_runs() -> None:
    me = os.getpid()
    assert RunState("a", "", "", owner=me, owner_started=process_started(me) or "").owner_alive()
    assert RunState("b", "", "", owner=dead_pid(), owner_started="1").owner_alive() is False
    # The pid reused by another process: not the owner.
    assert RunState("c", "", "", owner=me, owner_started="0").owner_alive() is False
    assert RunState("d", "", "").owner_alive() is None  # written by an older rig


def test_the_sweep_removes_dead_runs_and_never_a_live_one(ip: list[tuple[str, ...]]) -> None:
    me = os.getpid()
    live = RunState("aaaa", "10.70.0.0/24", "phxaaaabr", ["phxaaaa-h0"], ["phxaaaabr"])
    live.owner, live.owner_started = me, process_started(me) or ""
    dead = RunState("bbbb", "10.70.1.0/24", "phxbbbbbr", ["phxbbbb-h0"], ["phxbbbbbr"])
    dead.owner, dead.owner_started = dead_pid(), "1"
    old = RunState("cccc", "10.70.2.0/24", "phxccccbr", ["phxcccc-h0"], ["phxccccbr"])
    for state in (live, dead, old):
        state.save()

    assert fleet.down_all(everything=False) == {"removed": ["bbbb"], "kept": ["aaaa", "cccc"]}
    touched = {c[-1] for c in ip if c[:3] in (("ip", "netns", "del"), ("ip", "link", "del"))}
    assert touched == {"phxbbbb-h0", "phxbbbbbr"}
    assert sorted(d.name for d in net.STATE_ROOT.iterdir()) == ["aaaa", "cccc"]

    # python -m tests.rig down: the runs that do not name their owner too; a live one, never.
    assert fleet.down_all() == {"removed": ["cccc"], "kept": ["aaaa"]}
    assert [d.name for d in net.STATE_ROOT.iterdir()] == ["aaaa"]
