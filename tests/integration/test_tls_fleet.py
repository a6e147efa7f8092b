"""A whole fleet over TLS: the API, the agents' HTTP and the peer tier all HTTPS, with
certificates from one throw-away CA (``phalanx.certs``, as ``phalanx local up --tls``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.certs import make_authority
from phalanx.tls import client_context
from tests.harness import Broker, Fleet, wait_for
from tests.tinylm import REPO, tinylm

pytestmark = pytest.mark.integration

TIERS = ["ram", "nvme", "peer"]


@pytest.fixture
def tls_fleet(tmp_path: Path, broker: Broker) -> Iterator[Fleet]:
    f = Fleet(tmp_path, broker, tls=True)
    yield f
    f.stop()


def test_a_tls_fleet_runs_a_job_whose_peer_copies_land_and_the_cli_reads_it_over_https(
    tls_fleet: Fleet,
) -> None:
    fleet = tls_fleet
    fleet.start_supervisor()
    fleet.start_nodes(2, racks=2)
    assert fleet.api_url.startswith("https://")

    job = fleet.run_job(
        name="tls",
        nodes=2,
        ranks_per_node=1,
        workdir=str(REPO),
        command=tinylm("--log-every", "1000", "--steps", "8", "--ckpt-every", "4"),
        checkpoint={"tiers": TIERS, "keep": {"ram": 1, "nvme": 1, "peer": 1}},
        guard="off",  # `keep` alone: the loss guard holds older steps of its own
    )

    # The peer copies went over HTTPS to the buddy and were committed at tier peer ...
    def committed() -> dict[int, list[str]]:
        out = fleet.cli("ckpt", "ls", job["id"], "-o", "json")
        assert out.returncode == 0, out.stderr
        return {s["step"]: sorted(s["committed"]) for s in json.loads(out.stdout)["steps"]}

    wait_for(lambda: committed() == {8: ["nvme", "peer"]}, 30, "step 8 at nvme and peer")
    for node, buddy, rank in (("n01", "n02", 0), ("n02", "n01", 1)):
        copy = fleet.root / "nodes" / buddy / "data" / "ckpt-peer" / job["id"] / "000000000008"
        assert (copy / f"rank-{rank:05d}.phx.zst").is_file(), f"{node}'s copy on {buddy}"
    # ... and the supervisor fetched a rank's log from its agent over HTTPS.
    log = fleet.cli("logs", job["id"], "--rank", "0")
    assert log.returncode == 0, log.stderr
    assert json.loads(log.stdout.strip().splitlines()[-1])["done"] is True


def test_a_client_trusting_another_ca_is_refused_with_a_clear_error(
    tls_fleet: Fleet, tmp_path: Path
) -> None:
    fleet = tls_fleet
    fleet.start_supervisor()
    fleet.start_agent("n01")
    node = fleet.wait_state("n01", "up")
    other = make_authority(tmp_path / "other-ca")

    refused = fleet.cli("nodes", PHALANX_CA=str(other.ca))

    assert refused.returncode == 1
    assert "Traceback" not in refused.stderr
    assert refused.stderr.strip() == (
        f"phalanx: the supervisor at {fleet.api_url} presented a certificate that the CA in "
        f"{other.ca} does not accept (unable to get local issuer certificate); point "
        "PHALANX_CA (or --ca) at the CA that signed the supervisor's certificate"
    )
    # The agents' port is as strict: a client trusting another CA never gets through.
    agent = f"https://127.0.0.1:{node['http_port']}/healthz"
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(agent, timeout=5, context=client_context(other.ca))
    assert fleet.authority is not None
    with urllib.request.urlopen(agent, timeout=5, context=client_context(fleet.authority.ca)) as r:
        assert json.loads(r.read())["node"] == "n01"


def test_the_cli_takes_the_ca_from_its_ca_option(tls_fleet: Fleet) -> None:
    fleet = tls_fleet
    fleet.start_supervisor()
    assert fleet.authority is not None

    listed = fleet.cli("--ca", str(fleet.authority.ca), "nodes", "-o", "json", PHALANX_CA="")

    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == []
