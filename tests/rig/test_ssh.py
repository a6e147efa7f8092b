"""The SSH fleet without real machines: built from an inventory file, with a fake in place
of the one function that runs ssh (it answers as the lab's hosts would and records every
command), and the supervisor's API answered by a fake. Each fault is struck and the exact
commands sent to each host are checked."""

from __future__ import annotations

import functools
import random
import shlex
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from phalanx.certs import make_authority
from tests.rig import __main__ as cli
from tests.rig.base import Fleet
from tests.rig.faults import FAULTS, Strike
from tests.rig.fleet import RigFleet
from tests.rig.net import RigError
from tests.rig.shards import REMOTE
from tests.rig.ssh import KILL_RANK, SIM_CLEAR, SIM_INJECT, SshFleet, tunnel_argv

PY = "/opt/phalanx/venv/bin/python"
INVENTORY = """\
[brokers]
ctl ansible_host=10.0.0.2
[supervisors]
ctl ansible_host=10.0.0.2
[agents]
gpu1.lab.internal ansible_host=10.0.0.11 phalanx_rack=r1 phalanx_rig_iface=ens5
gpu2 ansible_host=10.0.0.12 phalanx_rack=r2 phalanx_rig_iface=ens5
gpu3 ansible_host=10.0.0.13 phalanx_rack=r1 phalanx_rig_iface=ens5
gpu4 ansible_host=10.0.0.14 phalanx_rack=r2 phalanx_rig_iface=ens5
[agents:vars]
phalanx_agent_gpu_backend=sim
"""
ADDRESSES = {"10.0.0.11": "gpu1", "10.0.0.12": "gpu2", "10.0.0.13": "gpu3", "10.0.0.14": "gpu4"}
AGENT_UNIT = (
    "LoadState=loaded\nUser=phalanx\nExecStart={ path=/opt/phalanx/venv/bin/phalanx-agentd ; "
    "argv[]=/opt/phalanx/venv/bin/phalanx-agentd --config /etc/phalanx/agentd.toml ; "
    "ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) }\n"
)
SUPERVISOR_UNIT = (
    "LoadState=loaded\nUser=phalanx-supervisor\nExecStart={ path=/opt/phalanx-supervisor/venv/"
    "bin/phalanx-supervisor ; argv[]=/opt/phalanx-supervisor/venv/bin/phalanx-supervisor "
    "--config /etc/phalanx/supervisor.toml ; ignore_errors=no }\n"
)


def agentd_toml(node: str, backend: str) -> str:
    """As ansible/roles/agent/templates/agentd.toml.j2 renders it."""
    return (
        f'node_id = "{node}"\nrack = "r1"\ndata_dir = "/var/lib/phalanx"\nstop_grace_s = 30.0\n'
        'log_json = true\n\n[mqtt]\nhost = "mqtt01"\nport = 8883\ntls = true\n'
        f'username = "{node}"\npassword_file = "/etc/phalanx/agentd-mqtt-password"\n\n'
        f'[gpu]\nbackend = "{backend}"\nsim_gpus = 2\n\n[http]\nhost = "0.0.0.0"\nport = 9400\n'
    )


@functools.cache
def ca_pem() -> str:
    """A real CA certificate (the client builds its TLS context from it)."""
    with tempfile.TemporaryDirectory() as d:
        return make_authority(Path(d)).ca.read_text()


class Lab:
    """The fake behind ``SshHost.runner``: answers what the lab's hosts would answer and
    records every command, as (host, argv) with the host named by the node it runs."""

    def __init__(self, backend: str = "sim", down: Sequence[str] = ()) -> None:
        self.backend = backend
        self.down = set(down)
        self.sent: list[tuple[str, list[str]]] = []
        self.local: list[list[str]] = []
        self.inputs: dict[str, str] = {}
        self.answers: dict[str, tuple[int, str, str]] = {}  # remote command -> answer
        self.data_fs = "/var/lib/phalanx"
        self.api: FakeApi | None = None
        self.tls = False  # the supervisor's API serves HTTPS, as the roles set it up

    def __call__(
        self, argv: Sequence[str], timeout: float, input: str = ""
    ) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        if argv[0] != "ssh":
            self.local.append(argv)
            return subprocess.CompletedProcess(argv, 0, "PLAY RECAP ok", "")
        assert argv[-2] == "--"
        address = argv[-3].split("@", 1)[1]
        host = ADDRESSES.get(address, "ctl")
        remote = shlex.split(argv[-1])
        if address in self.down:
            msg = f"ssh: connect to host {address} port 22: No route to host"
            return subprocess.CompletedProcess(argv, 255, "", msg + "\n")
        self.sent.append((host, remote))
        if input:
            self.inputs[host] = input
        code, out, err = self.answer(host, remote)
        return subprocess.CompletedProcess(argv, code, out, err)

    def answer(self, host: str, argv: list[str]) -> tuple[int, str, str]:
        line = shlex.join(argv)
        if line in self.answers:
            return self.answers[line]
        if argv[:3] == ["systemctl", "show", "phalanx-agentd"]:
            return 0, AGENT_UNIT, ""
        if argv[:3] == ["systemctl", "show", "phalanx-supervisor"]:
            return 0, SUPERVISOR_UNIT, ""
        if argv == ["cat", "/etc/phalanx/agentd.toml"]:
            return 0, agentd_toml(host, self.backend), ""
        if argv == ["cat", "/etc/phalanx/supervisor.toml"]:
            api = '[api]\nhost = "10.0.0.2"\nport = 8740\ntoken_file = "/etc/phalanx/api-token"\n'
            top = 'state_dir = "/var/lib/phalanx-supervisor"\n'
            if self.tls:
                top += 'agent_tls = true\nagent_ca_file = "/etc/phalanx/http-ca.pem"\n'
                api += 'tls_cert_file = "/etc/phalanx/http.pem"\n'
            return 0, top + api, ""
        if argv == ["cat", "/etc/phalanx/http-ca.pem"]:
            return 0, ca_pem(), ""
        if argv == ["cat", "/etc/phalanx/api-token"]:
            return 0, "s3cret-token\n", ""
        if argv[:2] == ["df", "--output=target"]:
            return 0, f"Mounted on\n{self.data_fs}\n", ""
        if argv[:2] == ["sh", "-c"] and argv[2] == KILL_RANK and self.api is not None:
            self.api.generation += 1  # the supervisor relaunches the gang
            return 0, "4242\n", ""
        if argv[-1:] == ["ecc-dbe"] and self.api is not None:
            self.api.generation += 1  # the supervisor moves the gang off the GPU
        return 0, "", ""

    def to(self, host: str) -> list[list[str]]:
        """The commands sent to ``host``, in order."""
        return [argv for h, argv in self.sent if h == host]


class FakeApi:
    """The supervisor's REST API, as far as the faults ask it."""

    def __init__(self) -> None:
        self.generation = 1
        self.posted: list[str] = []
        self.nodes = [
            {"id": "gpu1", "state": "up", "address": "192.168.7.11"},
            {"id": "gpu2", "state": "up", "address": "192.168.7.12"},
            {"id": "gpu3", "state": "up", "address": "192.168.7.13", "spare": True},
            {"id": "gpu4", "state": "up", "address": "192.168.7.14"},
        ]

    def get(self, path: str) -> Any:
        if path == "/v1/jobs/j1":
            return {
                "id": "j1",
                "state": "running",
                "generation": self.generation,
                "nodes": ["gpu1", "gpu2"],
                "ranks": [{"rank": r, "node": "gpu1" if r < 2 else "gpu2"} for r in range(4)],
            }
        if path == "/v1/nodes":
            return self.nodes
        if path.startswith("/v1/nodes/"):
            return next(n for n in self.nodes if n["id"] == path.rsplit("/", 1)[1])
        raise AssertionError(f"unexpected GET {path}")

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        self.posted.append(path)
        for n in self.nodes:
            if path == f"/v1/nodes/{n['id']}/undrain":
                n["state"] = "up"
        return {}


def build(tmp_path: Path, lab: Lab, **kwargs: Any) -> SshFleet:
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(INVENTORY)
    kwargs.setdefault("api", "http://127.0.0.1:18740")
    kwargs.setdefault("token", "t")
    return SshFleet.from_inventory(inventory, runner=lab, **kwargs)


@pytest.fixture
def lab() -> Lab:
    return Lab()


@pytest.fixture
def fleet(tmp_path: Path, lab: Lab, monkeypatch: pytest.MonkeyPatch) -> SshFleet:
    f = build(tmp_path, lab, object_store_unit=("ctl", "minio"))
    lab.api = FakeApi()
    monkeypatch.setattr(f, "client", lambda: lab.api)
    monkeypatch.setattr("time.sleep", lambda s: None)
    lab.sent.clear()
    return f


def strike(fleet: SshFleet, kind: str, seed: int = 1) -> Strike:
    s = Strike(fleet, "j1", random.Random(seed))
    FAULTS[kind].inject(s)
    return s


# --- building the fleet -------------------------------------------------------------------


def test_hosts_are_named_by_node_id_and_laid_out_as_their_agentd_toml_says(
    tmp_path: Path, lab: Lab
) -> None:
    fleet = build(tmp_path, lab)
    assert [h.name for h in fleet.gpu_hosts] == ["gpu1", "gpu2", "gpu3", "gpu4"]
    assert fleet.host("gpu1").address == "10.0.0.11"
    agent = fleet.agents["gpu1"]
    assert (agent.user, agent.python, agent.backend) == ("phalanx", PY, "sim")
    assert str(agent.sim_file) == "/var/lib/phalanx/sim-gpus.json"
    assert str(fleet.nvme(fleet.host("gpu2"))) == "/var/lib/phalanx/ckpt"
    assert fleet.job_runtime() == {"python": PY, "workdir": "/opt/phalanx-rig"}
    assert fleet.daemon_host("supervisor").name == "ctl"


def test_every_host_is_asked_to_answer_and_each_agent_gets_the_jobs_script(
    tmp_path: Path, lab: Lab
) -> None:
    build(tmp_path, lab)
    assert lab.to("ctl") == [["true"]]  # api and token given: the supervisor is not read
    assert lab.to("gpu2") == [
        ["true"],
        [
            "systemctl",
            "show",
            "phalanx-agentd",
            "--property=LoadState",
            "--property=User",
            "--property=ExecStart",
        ],
        ["cat", "/etc/phalanx/agentd.toml"],
        ["df", "--output=target", "/var/lib/phalanx"],
        [PY, "-c", "import torch, phalanx.rank"],
        [
            "sh",
            "-c",
            "mkdir -p /opt/phalanx-rig/examples && cat > "
            "/opt/phalanx-rig/examples/tinylm.py.tmp && mv /opt/phalanx-rig/examples/tinylm.py.tmp "
            "/opt/phalanx-rig/examples/tinylm.py",
        ],
    ]
    assert lab.inputs["gpu2"] == (Path(cli.__file__).parents[2] / "examples/tinylm.py").read_text()


def test_a_host_that_does_not_answer_over_ssh_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(RigError) as err:
        build(tmp_path, Lab(down=["10.0.0.13"]))
    assert str(err.value) == (
        "host gpu3 (root@10.0.0.13, port 22) does not answer over SSH: "
        "ssh: connect to host 10.0.0.13 port 22: No route to host"
    )


def test_a_host_without_the_agents_unit_is_told_to_install_the_fleet(tmp_path: Path) -> None:
    lab = Lab()
    lab.answers[
        "systemctl show phalanx-agentd --property=LoadState --property=User --property=ExecStart"
    ] = (0, "LoadState=not-found\nUser=\nExecStart=\n", "")
    with pytest.raises(RigError, match=r"host gpu1.lab.internal has no phalanx-agentd unit"):
        build(tmp_path, lab)


def test_the_playbook_runs_first_only_when_asked(tmp_path: Path) -> None:
    quiet = Lab()
    build(tmp_path, quiet)
    assert quiet.local == []
    lab = Lab()
    build(tmp_path, lab, converge=True, ansible_args=["--vault-password-file=/root/vault"])
    repo = Path(cli.__file__).resolve().parents[2]
    assert lab.local == [
        [
            "ansible-playbook",
            "-i",
            str((tmp_path / "hosts.ini").resolve()),
            "--vault-password-file=/root/vault",
            str(repo / "ansible" / "site.yml"),
        ]
    ]


def test_the_api_address_and_token_are_read_from_the_supervisors_configuration(
    tmp_path: Path, lab: Lab
) -> None:
    fleet = build(tmp_path, lab, api=None, token=None)
    assert (fleet.api, fleet.token) == ("http://10.0.0.2:8740", "s3cret-token")
    assert ["cat", "/etc/phalanx/api-token"] in lab.to("ctl")


def test_an_https_api_is_called_at_https_verified_with_the_supervisors_ca(
    tmp_path: Path, lab: Lab
) -> None:
    lab.tls = True
    fleet = build(tmp_path, lab, api=None, token=None)
    try:
        assert fleet.api == "https://10.0.0.2:8740"
        assert fleet.ca_file is not None and fleet.ca_file.read_text() == ca_pem()
        assert fleet.client().ca_file == fleet.ca_file
    finally:
        fleet.close()
    assert not fleet.ca_file.exists()


def test_an_https_api_given_by_hand_is_verified_with_the_supervisors_ca(
    tmp_path: Path, lab: Lab
) -> None:
    lab.tls = True
    with build(tmp_path, lab, api="https://10.0.0.2:8740") as fleet:
        assert fleet.ca_file is not None and fleet.ca_file.read_text() == ca_pem()


def test_an_https_api_without_a_ca_to_verify_it_is_refused_by_name(
    tmp_path: Path, lab: Lab
) -> None:
    with pytest.raises(RigError, match="names no agent_ca_file"):
        build(tmp_path, lab, api="https://10.0.0.2:8740")


def test_an_api_on_loopback_is_reached_through_its_own_ssh_tunnel(tmp_path: Path, lab: Lab) -> None:
    fleet = build(tmp_path, lab)
    argv = tunnel_argv(fleet.daemon_host("supervisor"), 40001, 8740)
    assert argv[:7] == [
        "ssh",
        *("-o", "ControlMaster=no", "-o", "ControlPath=none", "-o", "ExitOnForwardFailure=yes"),
    ]
    assert argv[-5:] == ["22", "-N", "-L", "127.0.0.1:40001:127.0.0.1:8740", "root@10.0.0.2"]


def test_both_fleets_implement_every_operation_of_the_interface() -> None:
    assert not getattr(RigFleet, "__abstractmethods__", None)
    assert not getattr(SshFleet, "__abstractmethods__", None)
    assert issubclass(RigFleet, Fleet) and issubclass(SshFleet, Fleet)


# --- the faults, as commands on the hosts --------------------------------------------------


def test_kill_agent_sigkills_the_unit_then_restarts_it(fleet: SshFleet, lab: Lab) -> None:
    s = strike(fleet, "kill-agent")
    assert lab.sent == [
        (s.notes["host"], ["systemctl", "kill", "--signal=SIGKILL", "phalanx-agentd"]),
        (s.notes["host"], ["systemctl", "restart", "phalanx-agentd"]),
    ]


def test_kill_rank_sigkills_the_process_the_agent_gave_that_rank_and_generation(
    fleet: SshFleet, lab: Lab
) -> None:
    s = strike(fleet, "kill-rank")
    rank = s.notes["rank"]
    assert lab.sent == [(s.notes["host"], ["sh", "-c", KILL_RANK, "sh", "j1", str(rank), "1"])]
    assert "kill -KILL" in KILL_RANK and "PHALANX_GENERATION=$3" in KILL_RANK


def test_a_rank_that_is_not_running_is_said_so(fleet: SshFleet, lab: Lab) -> None:
    lab.answers[shlex.join(["sh", "-c", KILL_RANK, "sh", "j1", "0", "1"])] = (3, "", "")
    with pytest.raises(RigError, match="rank 0 of j1 is not running on gpu1"):
        fleet.kill_rank(fleet.host("gpu1"), "j1", 0, 1)


@pytest.mark.parametrize("kind", ["ecc-dbe", "xid-79", "thermal"])
def test_a_gpu_fault_edits_the_sim_file_as_the_agents_user(
    fleet: SshFleet, lab: Lab, kind: str
) -> None:
    s = strike(fleet, kind)
    sim = "/var/lib/phalanx/sim-gpus.json"
    assert lab.sent == [
        (
            s.notes["host"],
            [
                "runuser",
                "-u",
                "phalanx",
                "--",
                PY,
                "-c",
                SIM_INJECT,
                sim,
                str(s.notes["gpu"]),
                kind,
            ],
        )
    ]


def test_link_cut_is_one_command_on_the_rig_interface(fleet: SshFleet, lab: Lab) -> None:
    s = strike(fleet, "link-cut")
    assert lab.sent == [
        (s.notes["host"], ["sh", "-c", "ip link set ens5 down; sleep 10; ip link set ens5 up"])
    ]


def test_a_partition_blackholes_the_addresses_the_nodes_announced(
    fleet: SshFleet, lab: Lab
) -> None:
    strike(fleet, "partition")
    assert lab.to("gpu1") == [
        ["ip", "route", "replace", "blackhole", "192.168.7.12/32"],
        ["ip", "route", "del", "blackhole", "192.168.7.12/32"],
    ]
    assert lab.to("gpu2") == [
        ["ip", "route", "replace", "blackhole", "192.168.7.11/32"],
        ["ip", "route", "del", "blackhole", "192.168.7.11/32"],
    ]


def test_slow_link_is_netem_then_cleared(fleet: SshFleet, lab: Lab) -> None:
    s = strike(fleet, "slow-link")
    netem = "tc qdisc replace dev ens5 root netem delay 100ms loss 5%"
    assert lab.sent == [
        (s.notes["host"], netem.split()),
        (s.notes["host"], ["tc", "qdisc", "del", "dev", "ens5", "root"]),
    ]


def test_slow_link_caps_the_rate_where_the_kernel_has_no_netem(fleet: SshFleet, lab: Lab) -> None:
    netem = "tc qdisc replace dev ens5 root netem delay 100ms loss 5%"
    lab.answers[netem] = (2, "", "Error: Specified qdisc kind is unknown.\n")
    s = strike(fleet, "slow-link")
    tbf = "tc qdisc replace dev ens5 root tbf rate 512kbit burst 16kbit latency 500ms"
    assert lab.to(s.notes["host"])[1] == tbf.split()


@pytest.mark.parametrize(
    ("kind", "unit"),
    [("broker-restart", "mosquitto"), ("supervisor-restart", "phalanx-supervisor")],
)
def test_a_control_daemon_is_killed_and_restarted_through_systemd(
    fleet: SshFleet, lab: Lab, kind: str, unit: str
) -> None:
    strike(fleet, kind)
    assert lab.sent == [
        ("ctl", ["systemctl", "kill", "--signal=SIGKILL", unit]),
        ("ctl", ["systemctl", "restart", unit]),
    ]


def test_disk_full_fills_the_nvme_filesystem_and_removes_the_ballast(
    fleet: SshFleet, lab: Lab
) -> None:
    lab.answers["stat -f -c '%a %S' /var/lib/phalanx/ckpt"] = (0, "0 4096\n", "")
    s = strike(fleet, "disk-full")
    sent = lab.to(s.notes["host"])
    assert sent[0][:2] == ["sh", "-c"] and "fallocate" in sent[0][2]
    assert "dd if=/dev/zero of=/var/lib/phalanx/ckpt/.rig-ballast" in sent[0][2]
    assert sent[1:] == [
        ["stat", "-f", "-c", "%a %S", "/var/lib/phalanx/ckpt"],
        ["rm", "-f", "/var/lib/phalanx/ckpt/.rig-ballast"],
    ]
    assert s.notes["free_bytes"] == 0


def test_disk_full_is_refused_where_the_nvme_tier_is_on_the_root_filesystem(
    tmp_path: Path,
) -> None:
    lab = Lab()
    lab.data_fs = "/"
    fleet = build(tmp_path, lab)
    why = fleet.cannot("disk-full")
    assert why is not None and "that is /" in why


def test_shard_corrupt_flips_the_ram_slot_and_the_nvme_file_then_kills_the_rank(
    fleet: SshFleet, lab: Lab
) -> None:
    for r in range(4):  # whichever rank the seed picks: its newest sealed step is 40
        slot = shlex.join([PY, "-c", REMOTE, "slot", "/dev/shm", "j1", str(r)])
        lab.answers[slot] = (0, f"/dev/shm/phalanx-j1-r{r}.slot1 40 1000\n", "")
        nvme = f"/var/lib/phalanx/ckpt/j1/000000000040/rank-{r:05d}.phx"
        lab.answers[f"stat -c %s {nvme}"] = (0, "5000\n", "")
    s = strike(fleet, "shard-corrupt")
    rank = s.notes["rank"]
    slot = f"/dev/shm/phalanx-j1-r{rank}.slot1"
    nvme = f"/var/lib/phalanx/ckpt/j1/000000000040/rank-{rank:05d}.phx"
    assert lab.to(s.notes["host"]) == [
        [PY, "-c", REMOTE, "slot", "/dev/shm", "j1", str(rank)],
        ["stat", "-c", "%s", nvme],
        [PY, "-c", REMOTE, "flip", slot, str(4096 + 500)],
        [PY, "-c", REMOTE, "flip", nvme, "2500"],
        ["sh", "-c", KILL_RANK, "sh", "j1", str(rank), "1"],
    ]
    assert s.notes["flipped"] == [slot, nvme]


def test_peer_gone_cuts_the_link_detached_and_brings_it_back_after_the_scenario(
    fleet: SshFleet, lab: Lab
) -> None:
    s = strike(fleet, "peer-gone")
    cut = "ip link set ens5 down; sleep 330; ip link set ens5 up"
    detached = f"setsid -f sh -c {shlex.quote(cut)} </dev/null >/dev/null 2>&1"
    assert lab.sent == [(s.notes["cut_for_good"], ["sh", "-c", detached])]


def test_object_store_down_stops_and_continues_the_named_unit(fleet: SshFleet, lab: Lab) -> None:
    strike(fleet, "object-store-down")
    assert lab.sent == [
        ("ctl", ["systemctl", "kill", "--signal=SIGSTOP", "minio"]),
        ("ctl", ["systemctl", "kill", "--signal=SIGCONT", "minio"]),
    ]


def test_object_store_down_without_a_unit_says_what_it_needs(tmp_path: Path, lab: Lab) -> None:
    fleet = build(tmp_path, lab)
    why = fleet.cannot("object-store-down")
    assert why is not None and "--object-store-unit HOST:UNIT" in why
    assert "DATA_DIR/ckpt-objects" in why


def test_double_fault_kills_a_rank_then_breaks_a_gpu_of_the_other_job_host(
    fleet: SshFleet, lab: Lab
) -> None:
    s = strike(fleet, "double-fault")
    first, second = s.notes["host"], s.notes["second_host"]
    assert first != second
    assert lab.sent == [
        (first, ["sh", "-c", KILL_RANK, "sh", "j1", str(s.notes["rank"]), "1"]),
        (
            second,
            [
                "runuser",
                "-u",
                "phalanx",
                "--",
                PY,
                "-c",
                SIM_INJECT,
                "/var/lib/phalanx/sim-gpus.json",
                "0",
                "ecc-dbe",
            ],
        ),
    ]


def test_fault_during_save_waits_on_the_host_for_a_step_to_land_then_kills(
    fleet: SshFleet, lab: Lab
) -> None:
    wait = [PY, "-c", REMOTE, "newstep", "/var/lib/phalanx/ckpt/j1", "30"]
    lab.answers[shlex.join(wait)] = (0, "000000000050\n", "")
    s = strike(fleet, "fault-during-save")
    assert lab.to(s.notes["host"]) == [
        wait,
        ["sh", "-c", KILL_RANK, "sh", "j1", str(s.notes["rank"]), "1"],
    ]
    assert s.notes["step_dir"] == "000000000050"


def test_bad_spare_breaks_a_gpu_of_a_job_host_and_of_the_spare(fleet: SshFleet, lab: Lab) -> None:
    s = strike(fleet, "bad-spare")
    sim = "/var/lib/phalanx/sim-gpus.json"
    inject = ["runuser", "-u", "phalanx", "--", PY, "-c", SIM_INJECT, sim]
    assert s.notes["spare"] == "gpu3"
    assert lab.sent == [
        (s.notes["host"], [*inject, "0", "ecc-dbe"]),
        ("gpu3", [*inject, "1", "ecc-dbe"]),
    ]


def test_slow_spare_slows_the_spares_link_until_a_gpu_fault_moved_the_gang(
    fleet: SshFleet, lab: Lab
) -> None:
    s = strike(fleet, "slow-spare")
    sim = "/var/lib/phalanx/sim-gpus.json"
    inject = ["runuser", "-u", "phalanx", "--", PY, "-c", SIM_INJECT, sim]
    netem = "tc qdisc replace dev ens5 root netem delay 100ms loss 5%"
    assert s.notes["spare"] == "gpu3"
    assert lab.sent == [
        ("gpu3", netem.split()),
        (s.notes["host"], [*inject, "0", "ecc-dbe"]),
        ("gpu3", ["tc", "qdisc", "del", "dev", "ens5", "root"]),
    ]


def test_code_error_sends_nothing(fleet: SshFleet, lab: Lab) -> None:
    strike(fleet, "code-error")
    assert lab.sent == []


def test_every_fault_is_covered_here() -> None:
    covered = {
        "kill-agent",
        "kill-rank",
        "ecc-dbe",
        "xid-79",
        "thermal",
        "link-cut",
        "partition",
        "slow-link",
        "broker-restart",
        "supervisor-restart",
        "disk-full",
        "shard-corrupt",
        "peer-gone",
        "object-store-down",
        "double-fault",
        "fault-during-save",
        "bad-spare",
        "slow-spare",
        "code-error",
    }
    assert covered == set(FAULTS)


# --- what the driver reads, and the fleet between scenarios ---------------------------------


def test_a_rank_log_is_read_from_the_agents_data_dir(fleet: SshFleet, lab: Lab) -> None:
    path = "/var/lib/phalanx/jobs/j1/g2/rank-3.log"
    lab.answers[f"cat {path}"] = (0, '{"step": 7}\n', "")
    job = {"id": "j1", "generation": 2, "ranks": [{"rank": 3, "node": "gpu2"}]}
    assert fleet.rank_log(job, 3) == '{"step": 7}\n'
    lab.answers[f"cat {path}"] = (1, "", "cat: no such file\n")
    with pytest.raises(FileNotFoundError, match=r"gpu2:/var/lib/phalanx/jobs/j1/g2/rank-3\.log"):
        fleet.rank_log(job, 3)


def test_the_object_tier_is_each_nodes_folder_listed_where_it_lives(
    fleet: SshFleet, lab: Lab
) -> None:
    folder = "/var/lib/phalanx/ckpt-objects/j1/000000000040"
    lab.answers[f"ls -1 {folder}"] = (0, "", "")
    assert fleet.object_shards("j1", 40) == set()
    lab.answers[f"ls -1 {folder}"] = (0, "rank-00000.phx.zst\nrank-00001.phx.zst\n", "")
    assert fleet.object_shards("j1", 40) == {"rank-00000", "rank-00001"}
    assert all(["ls", "-1", folder] in lab.to(h) for h in ("gpu1", "gpu2", "gpu3", "gpu4"))


def test_a_scenario_starts_from_a_tidy_fleet_with_every_agent_node_up(
    fleet: SshFleet, lab: Lab
) -> None:
    assert lab.api is not None
    lab.api.nodes[1]["state"] = "drain"
    with fleet.scenario():
        pass
    assert lab.to("gpu2") == [
        ["rm", "-f", "/var/lib/phalanx/ckpt/.rig-ballast"],
        ["runuser", "-u", "phalanx", "--", PY, "-c", SIM_CLEAR, "/var/lib/phalanx/sim-gpus.json"],
    ]
    assert lab.api.posted == ["/v1/nodes/gpu2/undrain"]


def test_sim_gpu_faults_on_agents_with_real_gpus_are_refused_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = build(tmp_path, Lab(backend="nvml"))
    monkeypatch.setattr(SshFleet, "from_inventory", classmethod(lambda cls, *a, **k: fleet))
    code = cli.main(["run", "--inventory", str(tmp_path / "hosts.ini"), "--fault", "ecc-dbe"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("rig: ecc-dbe cannot run on this fleet: ecc-dbe edits the simulated")
    assert 'backend = "sim"' in err and "gpu1, gpu2, gpu3, gpu4 run nvml" in err
    assert fleet.cannot("kill-rank") is None


def test_a_scenario_waits_for_a_host_the_last_one_cut_off(
    fleet: SshFleet, lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    lab.down = {"10.0.0.12"}  # peer-gone's link still down
    monkeypatch.setattr("time.sleep", lambda s: lab.down.clear())  # back a while later
    with fleet.scenario():
        pass
    assert lab.to("gpu2") == [
        ["rm", "-f", "/var/lib/phalanx/ckpt/.rig-ballast"],
        ["runuser", "-u", "phalanx", "--", PY, "-c", SIM_CLEAR, "/var/lib/phalanx/sim-gpus.json"],
    ]


def test_a_host_that_never_comes_back_fails_the_scenario_naming_it(
    fleet: SshFleet, lab: Lab, monkeypatch: pytest.MonkeyPatch
) -> None:
    lab.down = {"10.0.0.12"}
    monkeypatch.setattr("tests.rig.ssh.NODES_UP_S", 0.0)
    gone = r"^host gpu2 \(root@10.0.0.12, port 22\) does not answer"
    with pytest.raises(RigError, match=gone), fleet.scenario():
        pass
