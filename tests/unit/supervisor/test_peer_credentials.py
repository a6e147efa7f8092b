"""The supervisor sends each node its own credential at the buddy holding a peer copy, and
no other node's: in the catalog it sends that node (issue 16). The credential travels in
the message's JSON and shows nowhere else (repr, a Python dump)."""

from __future__ import annotations

import time
from pathlib import Path

from phalanx import wire
from phalanx.agent_tokens import AgentKeys
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.store import Store

KEYS = AgentKeys("fleet-agent-secret-0123456789abcdef")
PEERS = {
    n: wire.PeerAddr(node=n, address="127.0.0.1", http_port=9400 + i)
    for i, n in enumerate(("n01", "n02", "n03"))
}


def land(
    catalog: CheckpointCatalog, step: int, rank: int, node: str, tier: str, holder: str | None
) -> None:
    """Rank ``rank``'s shard of ``step`` of the 2-rank job j-1, landed at ``tier``."""
    catalog.on_landing(
        wire.CkptLanding(
            node=node,
            job="j-1",
            step=step,
            rank=rank,
            tier=tier,  # type: ignore[arg-type]
            nbytes=100 + step,
            checksum=f"xxh3_128:{step:016x}{rank:016x}",
            holder=holder,
            at=time.time(),
        ),
        world_size=2,
    )


def catalog_with_peer_copies(tmp_path: Path) -> CheckpointCatalog:
    """Step 5 of a 2-rank job: rank 0 on n01 (its peer copy on n02), rank 1 on n02 (its
    peer copy on n01)."""
    catalog = CheckpointCatalog(Store(tmp_path / "state.db"))
    for rank, node, holder in ((0, "n01", "n02"), (1, "n02", "n01")):
        for tier in ("nvme", "peer"):
            land(catalog, 5, rank, node, tier, holder if tier == "peer" else None)
    return catalog


def peers_in(msg: wire.CkptCatalog) -> dict[int, wire.PeerAddr]:
    return {s.rank: s.peer for st in msg.steps for s in st.shards if s.peer is not None}


def test_each_catalog_carries_its_own_nodes_credential_at_the_holder_only(
    tmp_path: Path,
) -> None:
    catalog = catalog_with_peer_copies(tmp_path)

    msgs = catalog.messages(
        "j-1",
        2,
        placement={0: "n01", 1: "n03"},  # rank 1 moved to the spare n03
        peers=PEERS,
        credential=KEYS.peer_credential,
    )

    by_node = {m.node: m for m in msgs}
    spare = peers_in(by_node["n03"])[1]
    assert spare.node == "n01"
    assert spare.token is not None
    assert spare.token.get_secret_value() == KEYS.peer_credential("n01", "n03")
    own = peers_in(by_node["n01"])[0]
    assert own.token is not None
    assert own.token.get_secret_value() == KEYS.peer_credential("n02", "n01")
    everyone_elses = {
        KEYS.peer_credential(holder, other) for holder in PEERS for other in PEERS if other != "n03"
    }
    assert not any(c.encode() in wire.encode(by_node["n03"]) for c in everyone_elses)


def test_a_catalog_sends_the_credential_in_json_and_hides_it_elsewhere(tmp_path: Path) -> None:
    catalog = catalog_with_peer_copies(tmp_path)
    msg = next(
        m
        for m in catalog.messages(
            "j-1", 2, placement={0: "n01", 1: "n02"}, peers=PEERS, credential=KEYS.peer_credential
        )
        if m.node == "n01"
    )
    credential = KEYS.peer_credential("n02", "n01")

    assert credential.encode() in wire.encode(msg)
    assert credential not in repr(msg) and credential not in str(msg.model_dump())
    parsed = wire.parse(wire.catalog_topic("j-1", "n01"), wire.encode(msg)).message
    assert isinstance(parsed, wire.CkptCatalog)
    assert peers_in(parsed)[0].token == peers_in(msg)[0].token


def test_without_a_fleet_secret_no_credential_is_sent(tmp_path: Path) -> None:
    catalog = catalog_with_peer_copies(tmp_path)

    msgs = catalog.messages(
        "j-1",
        2,
        placement={0: "n01", 1: "n02"},
        peers=PEERS,
        credential=AgentKeys("").peer_credential,
    )

    assert all(p.token is None for m in msgs for p in peers_in(m).values())


def test_a_catalogs_payload_is_its_messages_encoding_with_steps_listed_again(
    tmp_path: Path,
) -> None:
    catalog = catalog_with_peer_copies(tmp_path)
    args = {"placement": {0: "n01", 1: "n03"}, "peers": PEERS, "credential": KEYS.peer_credential}

    def payloads(**kwargs: object) -> list[bytes]:
        built = list(catalog.iter_payloads("j-1", 2, **{**args, **kwargs}))
        assert [p for _, p in built] == [wire.encode(m) for m, _ in built]
        assert all(wire.parse(wire.catalog_topic("j-1", m.node), p).message == m for m, p in built)
        return [p for _, p in built]

    first = payloads(hold_steps=10)
    assert payloads(hold_steps=10) == first  # step 5 listed again, from its kept bytes
    for rank, node in ((0, "n01"), (1, "n02")):
        land(catalog, 6, rank, node, "nvme", None)
    assert payloads(hold_steps=10) != first  # step 6 new, step 5 as before
    payloads(elastic=True)  # a job that reshapes: no listing is kept, each step encoded
    payloads(ended=True, nodes=["n01", "n02", "n03"])
    payloads(alive=set())  # nothing readable: a restore note naming ranks and nodes
    # A gang of three restoring what two saved: some nodes' messages carry sources, not all
    # (each of those is encoded whole; the others share the first's envelope).
    grown = list(
        catalog.iter_payloads(
            "j-1", 3, **{**args, "placement": {0: "n01", 1: "n03", 2: "n02"}, "elastic": True}
        )
    )
    assert any(m.sources for m, _ in grown) and not all(m.sources for m, _ in grown)
    assert [p for _, p in grown] == [wire.encode(m) for m, _ in grown]
