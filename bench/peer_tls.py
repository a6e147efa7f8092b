"""What TLS costs the peer tier: one checkpoint pushed to a buddy agent over plain HTTP
and over HTTPS, in the same run. Prints JSON.

    python bench/peer_tls.py --size-gib 1 [--rounds 3] [--dtype float32|bfloat16]

The buddy is agentd's peer routes (the seal check, the O_DIRECT staging) in a process
of its own on a loopback port, served plain or with a certificate from a throw-away CA
(``phalanx.certs``); the sender is a ``Checkpointer`` whose only tier below RAM is the
peer tier, as an agent builds it (zstd where it pays; on fp32 noise it does not, so
the bytes go raw). Rounds alternate plain and TLS, each on a fresh buddy, so that
drift on a shared machine hits both alike. Per mode: ``write_s`` (save to landed at
the peer), the CPU seconds of the sender's write-down threads and of the buddy, and
the medians; ``tls_over_plain`` is the median TLS push over the median plain one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from checkpointing import GIB, RAM_DIR, cpu_seconds, make_state, nbytes_of  # bench/

from ckpt import Checkpointer, LocalFolderStore, ObjectTier, Pacing
from ckpt.peer import HttpPeerStore
from phalanx.certs import make_authority
from phalanx.local import free_port
from phalanx.tls import client_context


def serve_buddy(root: Path, port: int, cert: str, key: str) -> None:
    """A buddy's peer routes on ``port`` (HTTPS when ``cert`` is given); stops on SIGTERM."""
    import concurrent.futures
    from types import SimpleNamespace

    from aiohttp import web

    from agentd.access import Access
    from agentd.ckpt import add_peer_routes
    from phalanx.tls import server_context

    pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="ckpt-peer")
    agent = SimpleNamespace(
        node="buddy",
        ckpt=SimpleNamespace(
            peer_root=root, peer_io=pool, pacing=Pacing(), peer_store=LocalFolderStore(root)
        ),
    )
    app = web.Application()
    add_peer_routes(app, agent, Access("buddy", "-"), max_shard_bytes=64 * GIB)
    tls = server_context(Path(cert), Path(key)) if cert else None
    web.run_app(app, host="127.0.0.1", port=port, ssl_context=tls, print=None)


class Buddy:
    def __init__(self, root: Path, cert: Path | None = None, key: Path | None = None) -> None:
        self.port = free_port()
        cmd = [sys.executable, __file__, "--serve-buddy", str(root), "--port", str(self.port)]
        if cert is not None and key is not None:
            cmd += ["--cert", str(cert), "--key", str(key)]
        self.child = subprocess.Popen(cmd)
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the buddy did not start (exit {self.child.poll()})"
                    ) from None
                time.sleep(0.05)
        self.stat = f"/proc/{self.child.pid}/stat"

    def stop(self) -> None:
        self.child.send_signal(signal.SIGTERM)
        try:
            self.child.wait(60)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()


def push(
    root: Path, state: dict[str, Any], buddy: Buddy, tls: ssl.SSLContext | None
) -> dict[str, float]:
    """One save written down to the peer tier alone."""
    pacing = Pacing()
    store = HttpPeerStore("buddy", "127.0.0.1", buddy.port, "-", ssl_context=tls)
    tier = ObjectTier(store, name="peer", pacing=pacing, level=pacing.compress_level)
    c = Checkpointer(
        dir=root,
        tiers=[tier],
        keep=1,
        pacing=pacing,
        ram_namespace=f"peertls-{uuid.uuid4().hex[:8]}",
    )
    try:
        c.reserve(state)
        stats = [f"/proc/self/task/{t.native_id}/stat" for t in c.engine.threads]
        mine, theirs = cpu_seconds(stats), cpu_seconds([buddy.stat])
        c.save(1, state)
        c.wait()
        return {
            "write_s": next(e.seconds for e in c.events if e.kind == "landed" and e.tier == "peer"),
            "sender_cpu_s": cpu_seconds(stats) - mine,
            "buddy_cpu_s": cpu_seconds([buddy.stat]) - theirs,
        }
    finally:
        c.close()
        c.ram.unlink()
        shutil.rmtree(root, ignore_errors=True)


def negotiated(port: int, client: ssl.SSLContext) -> str:
    """The TLS version and cipher the buddy and the sender agree on."""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        client.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        cipher = tls.cipher()
        return f"{tls.version()} {cipher[0] if cipher else '?'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--serve-buddy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cert", default="", help=argparse.SUPPRESS)
    parser.add_argument("--key", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_buddy:
        serve_buddy(Path(args.serve_buddy), args.port, args.cert, args.key)
        return

    root = Path(tempfile.mkdtemp(prefix="phalanx-peer-tls-"))
    if args.dtype == "bfloat16":  # zstd pays on bf16 (~22% at level 1): fewer bytes sent
        state = make_state(args.size_gib * 2)  # as many fp32 values as bf16 ones wanted
        state["model"] = {k: v.to(torch.bfloat16) for k, v in state["model"].items()}
    else:
        state = make_state(args.size_gib)
    authority = make_authority(root / "pki")
    files = authority.issue("buddy")
    client = client_context(authority.ca)
    out: dict[str, Any] = {
        "size_bytes": nbytes_of(state),
        "dtype": args.dtype,
        "openssl": ssl.OPENSSL_VERSION,
        "tls_version": None,
        "plain": [],
        "tls": [],
    }
    try:
        for i in range(args.rounds):
            for mode in ("plain", "tls") if i % 2 == 0 else ("tls", "plain"):
                buddy = (
                    Buddy(root / f"buddy-{mode}-{i}", files.cert, files.key)
                    if mode == "tls"
                    else Buddy(root / f"buddy-{mode}-{i}")
                )
                try:
                    if mode == "tls" and out["tls"] == []:
                        out["tls_version"] = negotiated(buddy.port, client)
                    out[mode].append(
                        push(
                            root / f"sender-{mode}-{i}",
                            state,
                            buddy,
                            client if mode == "tls" else None,
                        )
                    )
                finally:
                    buddy.stop()
                    shutil.rmtree(root / f"buddy-{mode}-{i}", ignore_errors=True)
        median = {
            mode: {k: statistics.median(r[k] for r in out[mode]) for k in out[mode][0]}
            for mode in ("plain", "tls")
        }
        out["median"] = median
        out["tls_over_plain"] = median["tls"]["write_s"] / median["plain"]["write_s"]
        gib = out["size_bytes"] / GIB
        out["gib_per_s"] = {mode: gib / median[mode]["write_s"] for mode in median}
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for segment in Path(RAM_DIR).glob("peertls-*.slot*"):
            segment.unlink(missing_ok=True)
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")


if __name__ == "__main__":
    main()
