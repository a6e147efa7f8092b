"""The scripts the SSH fleet runs on a real host, run here: the slot reader, the byte flip
and the step wait must do what the namespace fleet's own functions do; the rank killer must
kill exactly the rank asked; the sim-GPU scripts must go through agentd's own code."""

from __future__ import annotations

import struct
import subprocess
import sys
import threading
from pathlib import Path

from tests.rig import shards
from tests.rig.ssh import KILL_RANK, SIM_CLEAR, SIM_INJECT

HEAD = struct.Struct(shards.SLOT_HEAD_FORMAT)


def slot(path: Path, state: int, step: int, nbytes: int) -> None:
    head = HEAD.pack(b"PHXSLOT\x00", 1, state, step, nbytes, 1 << 16, 7, b"\x00" * 16)
    path.write_bytes(head.ljust(shards.RAM_HEADER_NBYTES, b"\x00") + bytes(range(256)) * 4)


def remote(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", shards.REMOTE, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


def test_the_newest_sealed_slot_is_the_same_read_here_and_on_a_host(tmp_path: Path) -> None:
    slot(tmp_path / "phalanx-j1-r1.slot0", shards.SEALED, 30, 1000)
    slot(tmp_path / "phalanx-j1-r1.slot1", shards.SEALED, 40, 900)
    slot(tmp_path / "phalanx-j1-r1.slot2", 1, 50, 800)  # being written: not sealed
    slot(tmp_path / "phalanx-j1-r2.slot0", shards.SEALED, 60, 700)  # another rank
    here = shards.newest_slot(tmp_path, "j1", 1)
    assert here == (tmp_path / "phalanx-j1-r1.slot1", 40, 900)
    there = remote("slot", str(tmp_path), "j1", "1")
    assert there.stdout.split() == [str(here[0]), "40", "900"]
    assert remote("slot", str(tmp_path), "j1", "3").returncode == 3  # none: exit 3


def test_a_flip_inverts_the_same_byte_here_and_on_a_host(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(bytes(range(100)))
    b.write_bytes(bytes(range(100)))
    shards.flip(a, 10, 20)
    assert remote("flip", str(b), str(10 + 20 // 2)).returncode == 0
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes()[20] == 20 ^ 0xFF
    assert a.read_bytes()[:20] == bytes(range(20))


def test_a_host_reports_the_step_that_starts_landing_while_it_waits(tmp_path: Path) -> None:
    job = tmp_path / "j1"
    (job / "000000000010").mkdir(parents=True)
    # A new step every 0.3 s until the wait returns: whenever the script (a Python that
    # may take seconds to start on a loaded machine) took its first look, one comes after.
    done = threading.Event()
    made: list[str] = []

    def steps() -> None:
        step = 20
        while not done.wait(0.3):
            (job / f"{step:012d}").mkdir()
            made.append(f"{step:012d}")
            step += 10

    maker = threading.Thread(target=steps)
    maker.start()
    try:
        said = remote("newstep", str(job), "20").stdout.strip()
    finally:
        done.set()
        maker.join()
    assert said in made  # a step that came while it waited, never the one already there
    assert remote("newstep", str(job), "0.2").stdout == ""  # nothing new: nothing said


def test_the_rank_killer_kills_only_the_rank_of_that_job_and_generation() -> None:
    import os

    job = f"rig-test-{os.getpid()}"  # nobody else's rank on this machine can match

    def rank(job: str, r: int, gen: int) -> subprocess.Popen[bytes]:
        env = {**os.environ, "PHALANX_JOB_ID": job, "RANK": str(r), "PHALANX_GENERATION": str(gen)}
        code = "import time; time.sleep(60)"
        return subprocess.Popen([sys.executable, "-c", code, "examples/tinylm.py"], env=env)

    procs = [rank(job, 1, 1), rank(job, 1, 2), rank(job, 0, 2), rank(f"{job}x", 1, 2)]
    try:
        killer = ["sh", "-c", KILL_RANK, "sh", job, "1", "2"]
        done = subprocess.run(killer, capture_output=True, text=True, timeout=30)
        assert (done.returncode, done.stdout.strip()) == (0, str(procs[1].pid))
        assert procs[1].wait(10) == -9
        assert [p.poll() for p in (procs[0], procs[2], procs[3])] == [None, None, None]
        again = subprocess.run(killer, capture_output=True, text=True, timeout=30)
        assert again.returncode == 3  # no such rank any more
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_the_sim_gpu_scripts_inject_and_clear_with_the_agents_own_code(tmp_path: Path) -> None:
    from agentd.gpu.sim import new_state, read_state, write_state

    sim = tmp_path / "sim-gpus.json"
    write_state(sim, new_state("gpu1", 2, "sim"))
    subprocess.run([sys.executable, "-c", SIM_INJECT, str(sim), "1", "ecc-dbe"], check=True)
    assert [g["ecc_dbe_volatile"] for g in read_state(sim)["gpus"]] == [0, 1]
    subprocess.run([sys.executable, "-c", SIM_CLEAR, str(sim)], check=True)
    assert [g["ecc_dbe_volatile"] for g in read_state(sim)["gpus"]] == [0, 0]
