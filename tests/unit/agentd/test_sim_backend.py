"""The simulated GPU backend: a JSON file of healthy GPUs that `inject` breaks on demand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agentd.burnin import sim_recompute_check
from agentd.gpu.base import GpuBackendError, GpuSample, RecoveryAction, Throttle
from agentd.gpu.sim import FAULTS, SimBackend, inject, read_state, write_state
from phalanx.simgpu import (
    SIM_STEP_S,
    SLOW_GPU_FACTOR,
    SLOW_NVLINK_FACTOR,
    SimFileError,
)

MODEL = "Simulated H100 80GB HBM3"


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "sim" / "sim-gpus.json"


@pytest.fixture
def sim(path: Path) -> SimBackend:
    return SimBackend(path, node_id="n1", gpus=4, model=MODEL)


def _gpu(sim: SimBackend, index: int) -> GpuSample:
    (gpu,) = [g for g in sim.sample().gpus if g.index == index]
    return gpu


def test_a_new_file_is_created_with_n_gpus(sim: SimBackend, path: Path) -> None:
    inventory = sim.inventory()

    assert path.exists()
    assert [g.index for g in inventory] == [0, 1, 2, 3]
    assert [g.uuid for g in inventory] == [f"GPU-sim-n1-{i}" for i in range(4)]
    assert {g.model for g in inventory} == {MODEL}
    assert {g.memory_bytes for g in inventory} == {80 * 1024**3}


def test_a_new_file_samples_as_healthy_gpus(sim: SimBackend) -> None:
    sample = sim.sample()

    assert len(sample.gpus) == 4
    assert sample.xids == ()
    assert sample.errors == ()
    for gpu in sample.gpus:
        assert (gpu.ecc_dbe_volatile, gpu.ecc_sbe_volatile) == (0, 0)
        assert (gpu.remap_pending, gpu.remap_failed, gpu.retired_pending) == (False, False, False)
        assert gpu.temperature_c is not None and gpu.temp_slowdown_c is not None
        assert gpu.temperature_c < gpu.temp_slowdown_c
        assert gpu.throttle == frozenset()
        assert gpu.recovery_action is RecoveryAction.NONE
        assert gpu.nvlink_down == ()
        assert gpu.mem_total_bytes == 80 * 1024**3


def test_an_existing_file_is_kept_not_rewritten(path: Path) -> None:
    SimBackend(path, node_id="n1", gpus=4, model=MODEL)
    inject(path, 2, "ecc-dbe")

    again = SimBackend(path, node_id="n1", gpus=8, model=MODEL)

    assert len(again.inventory()) == 4
    assert _gpu(again, 2).ecc_dbe_volatile == 1


def test_ecc_dbe_counts_an_uncorrected_error_and_delivers_xid_48(
    sim: SimBackend, path: Path
) -> None:
    inject(path, 1, "ecc-dbe")

    sample = sim.sample()

    gpu = sample.gpus[1]
    assert (gpu.ecc_dbe_volatile, gpu.ecc_dbe_aggregate) == (1, 1)
    assert sample.xids == ((1, 48),)


def test_ecc_sbe_adds_a_burst_of_corrected_errors(sim: SimBackend, path: Path) -> None:
    inject(path, 1, "ecc-sbe")

    gpu = _gpu(sim, 1)

    assert gpu.ecc_sbe_volatile == 1000
    assert gpu.ecc_sbe_aggregate == 1000
    assert gpu.ecc_dbe_volatile == 0


def test_ecc_sbe_accumulates(sim: SimBackend, path: Path) -> None:
    inject(path, 1, "ecc-sbe")
    inject(path, 1, "ecc-sbe")

    assert _gpu(sim, 1).ecc_sbe_volatile == 2000


def test_xid_79_delivers_the_event_on_that_gpu(sim: SimBackend, path: Path) -> None:
    inject(path, 3, "xid-79")

    assert sim.sample().xids == ((3, 79),)


def test_thermal_heats_the_gpu_past_slowdown_and_throttles_it(sim: SimBackend, path: Path) -> None:
    inject(path, 0, "thermal")

    gpu = _gpu(sim, 0)

    assert gpu.temperature_c is not None and gpu.temp_slowdown_c is not None
    assert gpu.temp_shutdown_c is not None
    assert gpu.temp_slowdown_c <= gpu.temperature_c < gpu.temp_shutdown_c
    assert gpu.throttle == frozenset({Throttle.HW_THERMAL, Throttle.SW_THERMAL})


def test_row_remap_pending_marks_a_pending_remap(sim: SimBackend, path: Path) -> None:
    inject(path, 2, "row-remap-pending")

    assert _gpu(sim, 2).remap_pending is True
    assert _gpu(sim, 1).remap_pending is False


def test_gpu_lost_removes_the_gpu_from_samples_and_inventory(sim: SimBackend, path: Path) -> None:
    inject(path, 1, "gpu-lost")

    assert [g.index for g in sim.sample().gpus] == [0, 2, 3]
    assert [g.index for g in sim.inventory()] == [0, 2, 3]


def test_clear_makes_a_faulty_gpu_healthy_again(sim: SimBackend, path: Path) -> None:
    healthy = _gpu(sim, 1)
    for fault in ("ecc-dbe", "ecc-sbe", "thermal", "row-remap-pending", "gpu-lost"):
        inject(path, 1, fault)

    inject(path, 1, "clear")

    assert _gpu(sim, 1) == healthy


def test_clear_ends_a_simulated_nvml_failure_and_hang(sim: SimBackend, path: Path) -> None:
    state = read_state(path)
    state["nvml_error"] = "Driver Not Loaded"
    state["hang_s"] = 5
    write_state(path, state)

    inject(path, 0, "clear")

    assert (read_state(path)["nvml_error"], read_state(path)["hang_s"]) == (None, 0)
    assert len(sim.sample().gpus) == 4


def test_a_fault_on_one_gpu_leaves_the_others_alone(sim: SimBackend, path: Path) -> None:
    before = sim.sample().gpus

    inject(path, 1, "ecc-dbe")

    after = sim.sample().gpus
    assert [after[i] for i in (0, 2, 3)] == [before[i] for i in (0, 2, 3)]


def test_inject_returns_the_new_gpu_entry(sim: SimBackend, path: Path) -> None:
    entry = inject(path, 2, "row-remap-pending")

    assert entry["index"] == 2
    assert entry["remap_pending"] is True


def test_each_xid_is_delivered_once(sim: SimBackend, path: Path) -> None:
    inject(path, 0, "xid-79")
    first = sim.sample()
    inject(path, 1, "xid-79")

    second = sim.sample()
    third = sim.sample()

    assert first.xids == ((0, 79),)
    assert second.xids == ((1, 79),)
    assert third.xids == ()


def test_xids_from_before_a_backend_opened_are_not_delivered_to_it(path: Path) -> None:
    # As with NVML's event set: a restarted agent does not replay old XIDs.
    SimBackend(path, node_id="n1", gpus=2, model=MODEL)
    inject(path, 0, "xid-79")
    fresh = SimBackend(path, node_id="n1", gpus=2, model=MODEL)
    inject(path, 1, "xid-79")

    assert fresh.sample().xids == ((1, 79),)


def test_an_nvml_error_in_the_file_is_reported_as_a_node_error(sim: SimBackend, path: Path) -> None:
    state = read_state(path)
    state["nvml_error"] = "Driver Not Loaded"
    write_state(path, state)

    sample = sim.sample()

    assert sample.gpus == ()
    assert sample.errors == ("nvmlDeviceGetCount: Driver Not Loaded",)


def test_an_unknown_fault_raises_value_error_naming_it(sim: SimBackend, path: Path) -> None:
    with pytest.raises(ValueError, match="'melt'"):
        inject(path, 0, "melt")


def test_a_gpu_that_does_not_exist_raises_value_error_naming_it(
    sim: SimBackend, path: Path
) -> None:
    with pytest.raises(ValueError, match="GPU 9"):
        inject(path, 9, "ecc-dbe")


def test_every_documented_fault_is_accepted(sim: SimBackend, path: Path) -> None:
    for fault in FAULTS:
        inject(path, 0, fault)

    assert set(FAULTS) == {
        "ecc-dbe",
        "ecc-sbe",
        "xid-79",
        "thermal",
        "row-remap-pending",
        "gpu-lost",
        "sdc",
        "slow-gpu",
        "slow-nvlink",
        "clear",
    }


def test_an_sdc_fault_leaves_the_health_clean_and_fails_the_recompute_check(
    sim: SimBackend, path: Path
) -> None:
    before = sim.sample()
    inject(path, 1, "sdc")

    assert sim.sample() == before  # silent: nothing in what NVML would say
    assert sim.corrupt() == {1}
    assert sim_recompute_check([0, 1], sim.corrupt()) == [
        "recompute on GPU 1: its result differs from the CPU's (silent data corruption)"
    ]
    inject(path, 1, "clear")
    assert sim.corrupt() == frozenset() and sim_recompute_check([0, 1], frozenset()) == []


@pytest.mark.parametrize(
    "content",
    ["{not json", "[]", '{"gpus": 3}', "\x00\x01"],
    ids=["truncated", "list", "gpus-not-a-list", "binary"],
)
def test_a_corrupt_file_raises_gpu_backend_error_naming_the_path(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(content)

    with pytest.raises(GpuBackendError, match=re.escape(str(path))):
        SimBackend(path, node_id="n1", gpus=2, model=MODEL)


def test_a_file_corrupted_while_running_raises_gpu_backend_error_at_the_next_sample(
    sim: SimBackend, path: Path
) -> None:
    path.write_text("{half a fi")

    with pytest.raises(GpuBackendError, match=re.escape(str(path))):
        sim.sample()


def test_inject_into_a_corrupt_file_raises_a_value_error_naming_the_path(
    path: Path,
) -> None:
    path.parent.mkdir(parents=True)
    path.write_text("{not json")

    with pytest.raises(SimFileError, match=re.escape(str(path))):
        inject(path, 0, "ecc-dbe")


def test_a_bad_gpu_entry_raises_gpu_backend_error_naming_the_gpu(
    sim: SimBackend, path: Path
) -> None:
    state = read_state(path)
    state["gpus"][2]["throttle"] = ["overheated"]
    write_state(path, state)

    with pytest.raises(GpuBackendError, match="entry 2"):
        sim.sample()


def test_inject_leaves_no_temporary_file_behind(sim: SimBackend, path: Path) -> None:
    for fault in FAULTS:
        inject(path, 0, fault)

    assert [p.name for p in path.parent.iterdir()] == [path.name]
    json.loads(path.read_text())


def test_a_failed_write_leaves_the_file_intact_and_no_temporary_file(
    sim: SimBackend, path: Path
) -> None:
    before = path.read_text()

    with pytest.raises(TypeError):
        write_state(path, {"gpus": [], "unserialisable": {1, 2}})

    assert path.read_text() == before
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_the_slow_faults_slow_the_speed_a_burn_in_reports(sim: SimBackend, path: Path) -> None:
    healthy, sample = sim.perf(), sim.sample()
    assert healthy is not None and healthy["step_s"] == SIM_STEP_S
    inject(path, 1, "slow-gpu")
    inject(path, 0, "slow-nvlink")

    slow = sim.perf()

    assert slow is not None
    assert slow["gpu_step_s"]["1"] == SIM_STEP_S * SLOW_GPU_FACTOR == slow["step_s"]
    assert slow["allreduce_gbps"] == healthy["allreduce_gbps"] / SLOW_NVLINK_FACTOR
    assert sim.sample() == sample  # and nothing in the health says so
    inject(path, 1, "clear")
    inject(path, 0, "clear")
    assert sim.perf() == healthy
