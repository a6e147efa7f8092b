"""``phalanx.rank.run``'s own parts: which errors are a peer's, the group's connections
shut down (never a listener), and ``run`` outside Phalanx (``init_process_group`` then
``train()``). The whole in-process restart runs in
``tests/integration/test_recovery_training.py``."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch.distributed as dist

import phalanx.rank
from agentd.ranks import Rank, RankRunner
from phalanx import wire
from phalanx.local import free_port
from phalanx.rank import _inet_sockets, _peer_failed, _shut_down


async def _no_report(event: wire.RankEvent) -> None:
    return None


def test_gloo_and_nccl_errors_are_a_peers_and_the_scripts_own_are_not() -> None:
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: "
        "Connection reset by peer"
    )
    assert _peer_failed(gloo)
    assert _peer_failed(RuntimeError("[pair.cc:553] Connection closed by peer [10.0.0.2]:4"))
    assert _peer_failed(dist.DistNetworkError("the store's connection was lost"))
    # This rank's own: a timeout (a hang), a CUDA error, the script's exception.
    assert not _peer_failed(RuntimeError("[gloo] Timed out waiting 1800000ms for recv"))
    assert not _peer_failed(dist.DistBackendError("NCCL error: unhandled cuda error"))
    assert not _peer_failed(RuntimeError("injected failure at step 60"))
    assert not _peer_failed(ValueError("Connection reset by peer"))  # no RuntimeError


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket, socket.socket]]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _addr = listener.accept()
    yield listener, client, server
    for s in (listener, client, server):
        s.close()


def test_the_groups_connections_are_shut_down_and_its_listener_is_left(
    tcp_pair: tuple[socket.socket, socket.socket, socket.socket],
) -> None:
    listener, client, server = tcp_pair
    mine = {
        inode for inode, fd in _inet_sockets().items() if fd in (listener.fileno(), client.fileno())
    }
    assert len(mine) == 2

    assert _shut_down(mine) == 1  # the connection; the listener is left alone

    server.settimeout(5)
    assert server.recv(1) == b""  # the peer sees the end at once
    late = socket.create_connection(listener.getsockname(), timeout=5)  # still accepting
    late.close()
    assert client.fileno() >= 0  # shut down, not closed: the group closes its own


def test_outside_phalanx_run_starts_the_group_and_returns_what_train_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("PHALANX_IN_PROCESS", raising=False)

    def train() -> int:
        assert dist.is_initialized() and dist.get_world_size() == 1
        raise RuntimeError("gloo: Connection reset by peer")  # without in_process: raised

    try:
        with pytest.raises(RuntimeError, match="Connection reset"):
            phalanx.rank.run(train)
        assert phalanx.rank.run(lambda: 42) == 42  # the group is still there: not again
    finally:
        dist.destroy_process_group()


def test_an_in_process_start_keeps_each_live_ranks_gpu(tmp_path: Path) -> None:
    """Job Y's ranks 0 and 1 run on GPUs 6 and 7 (CUDA contexts do not move); job X holds
    0-3. Y's in-process start keeps them there and claims them, not the lowest free."""
    runner = RankRunner("n1", tmp_path, tmp_path / "a.sock", _no_report, gpus=list(range(8)))
    runner._claims["x-1"] = (1, {0, 1, 2, 3})
    for r in (0, 1):
        runner._ranks[("y-1", r)] = Rank(
            "y-1",
            1,
            wire.RankSlot(rank=r, local_rank=r, gpu=6 + r),
            cast(Any, SimpleNamespace(pid=1000 + r)),
            tmp_path / f"rank-{r}.log",
            0.0,
        )
    start = wire.StartRanksArgs(
        job="y-1",
        generation=2,
        command=["python", "train.py"],
        workdir=str(tmp_path),
        world_size=2,
        group_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
        ranks=[wire.RankSlot(rank=r, local_rank=r) for r in (0, 1)],
        in_process=True,
    )
    slots = runner._assign_gpus(start)
    assert [s.gpu for s in slots] == [6, 7]
    assert runner._claims["y-1"] == (2, {6, 7})
    cold = runner._assign_gpus(start.model_copy(update={"in_process": False, "generation": 3}))
    assert [s.gpu for s in cold] == [4, 5]  # a start that resumes nobody: the lowest free
