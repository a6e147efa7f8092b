"""The rig's hosts without building anything: the commands a fault runs on a namespace
host and over SSH on a real one, and the Ansible inventory the SSH hosts come from."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.rig.hosts import NetnsHost, SshHost, read_inventory
from tests.rig.net import RigError


def test_a_namespace_host_runs_a_command_inside_its_namespace() -> None:
    host = NetnsHost(name="h1", address="10.9.9.2", namespace="phx1234-h1")
    assert host.wrap(["ip", "link"]) == ["ip", "netns", "exec", "phx1234-h1", "ip", "link"]


def test_an_ssh_host_runs_a_command_as_one_quoted_string() -> None:
    host = SshHost(name="gpu1", address="192.0.2.11", user="ops", port=2222)
    argv = host.wrap(host.cut_link(10))
    assert argv[:2] == ["ssh", "-o"] and "BatchMode=yes" in argv
    assert argv[-3:] == [
        "ops@192.0.2.11",
        "--",
        "sh -c 'ip link set eth0 down; sleep 10; ip link set eth0 up'",
    ]
    assert argv[argv.index("-p") + 1] == "2222"


def test_a_link_cut_is_one_command_so_it_survives_the_ssh_session_it_cuts() -> None:
    host = SshHost(name="gpu1", address="192.0.2.11", iface="ens5")
    assert host.cut_link(7.5) == [
        "sh",
        "-c",
        "ip link set ens5 down; sleep 7.5; ip link set ens5 up",
    ]


def test_the_link_faults_are_tc_netem_and_blackhole_routes() -> None:
    host = SshHost(name="gpu1", address="192.0.2.11")
    assert host.slow_link(100, 5) == (
        ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", "100ms", "loss", "5%"]
    )
    assert host.clear_link() == ["tc", "qdisc", "del", "dev", "eth0", "root"]
    assert host.block("192.0.2.12") == ["ip", "route", "replace", "blackhole", "192.0.2.12/32"]
    assert host.unblock("192.0.2.12") == ["ip", "route", "del", "blackhole", "192.0.2.12/32"]


def test_daemons_on_real_hosts_are_killed_and_restarted_through_systemd() -> None:
    host = SshHost(name="gpu1", address="192.0.2.11")
    assert host.kill("agent") == ["systemctl", "kill", "--signal=SIGKILL", "phalanx-agentd"]
    assert host.restart("supervisor") == ["systemctl", "restart", "phalanx-supervisor"]


def test_a_disk_fill_and_its_undo_name_the_same_ballast_file() -> None:
    host = SshHost(name="gpu1", address="192.0.2.11")
    fill = host.fill(Path("/var/lib/phalanx/ckpt"))
    assert "of=/var/lib/phalanx/ckpt/.rig-ballast" in fill[-1]
    assert host.unfill(Path("/var/lib/phalanx/ckpt")) == [
        "rm",
        "-f",
        "/var/lib/phalanx/ckpt/.rig-ballast",
    ]


def test_the_inventory_gives_each_host_its_address_user_rack_and_roles(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "# the lab\n"
        "[brokers]\nctl ansible_host=192.0.2.1\n"
        "[supervisors]\nctl ansible_host=192.0.2.1\n"
        "[agents]\n"
        "gpu1 ansible_host=192.0.2.11 ansible_user=ops phalanx_rack=r1\n"
        "gpu2 ansible_host=192.0.2.12 ansible_port=2222 phalanx_rack=r2 phalanx_rig_iface=ens5\n"
        "[agents:vars]\nphalanx_gpu_backend=nvml\n"
    )
    hosts = {h.name: h for h in read_inventory(inventory)}
    assert sorted(hosts) == ["ctl", "gpu1", "gpu2"]
    assert hosts["ctl"].roles == ["control"] and hosts["ctl"].address == "192.0.2.1"
    assert (hosts["gpu1"].user, hosts["gpu1"].rack, hosts["gpu1"].roles) == ("ops", "r1", ["gpu"])
    assert (hosts["gpu2"].port, hosts["gpu2"].iface) == (2222, "ens5")


def test_an_inventory_line_that_is_not_key_value_is_refused_naming_it(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.ini"
    inventory.write_text("[agents]\ngpu1 ansible_host=192.0.2.11 oops\n")
    with pytest.raises(RigError, match=r"hosts.ini:2: expected key=value, got 'oops'"):
        read_inventory(inventory)


def test_agents_may_come_through_child_groups_and_take_their_groups_vars(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[all:vars]\nansible_user=ops\nphalanx_rig_iface=ens5\n"
        "[supervisors]\nsup ansible_host=192.0.2.1\n"
        "[rack_r12]\ngpu-a17 ansible_host=192.0.2.17\n"
        "gpu-a18 ansible_host=192.0.2.18 phalanx_rack=odd\n"
        "[rack_r12:vars]\nphalanx_rack='r12'\n"
        "[rack_r13]\ngpu-b01 ansible_host=192.0.2.31 ansible_user=root\n"
        "[rack_r13:vars]\nphalanx_rack=r13\n"
        "[agents:children]\nrack_r12\nrack_r13\n"
        "[agents:vars]\nphalanx_rack=none\nphalanx_rig_iface=ens6\n"
    )
    hosts = {h.name: h for h in read_inventory(inventory)}
    assert sorted(hosts) == ["gpu-a17", "gpu-a18", "gpu-b01", "sup"]
    a17, a18, b01 = hosts["gpu-a17"], hosts["gpu-a18"], hosts["gpu-b01"]
    assert a17.groups == ["rack_r12", "agents"] and a17.roles == ["gpu"]
    assert (a17.rack, a17.iface, a17.user) == ("r12", "ens6", "ops")  # nearest group wins
    assert (a18.rack, b01.rack, b01.user) == ("odd", "r13", "root")  # the host's own win
    assert (hosts["sup"].roles, hosts["sup"].iface) == (["control"], "ens5")


def test_the_inventorys_ssh_key_and_options_reach_the_ssh_command(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.ini"
    inventory.write_text(
        "[agents]\ngpu1 ansible_host=192.0.2.11 ansible_ssh_private_key_file=/keys/lab\n"
        "[agents:vars]\nansible_ssh_common_args='-o ProxyJump=bastion -o Compression=yes'\n"
    )
    (host,) = read_inventory(inventory)
    argv = host.wrap(["true"])
    assert argv[: argv.index("-p")] == [
        "ssh",
        *("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-i", "/keys/lab"),
        *("-o", "ProxyJump=bastion", "-o", "Compression=yes"),
    ]
