"""The node's tiers below RAM (``nvme``, ``peer``, ``object``), and what a plan makes
of them; ``ckpt.tiers`` is the library's tier interface they are built on.

``nvme`` is one ``DiskTier`` under ``DATA_DIR/ckpt`` for every rank; ``object`` the
object store (``ckpt.object_store``, a folder under ``DATA_DIR/ckpt-objects`` by
default), opened on first use; ``peer`` a buddy node's agent, over HTTP, as the plan
names it. What buddies push to this node is kept under ``DATA_DIR/ckpt-peer``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ssl
import threading
import time
from pathlib import Path

from ckpt import (
    DiskTier,
    HttpPeerStore,
    LocalFolderStore,
    ObjectStore,
    ObjectTier,
    Pacing,
    Tier,
    open_store,
)
from phalanx import wire

__all__ = ["LISTING_TTL_S", "NodeTiers"]

LISTING_TTL_S = 60.0  # a remote tier's listing of a job serves this node's ranks this long
_Listing = concurrent.futures.Future[list[str]]


class NodeTiers:
    """The tiers this node writes to and reads from; safe to use from threads."""

    def __init__(
        self,
        node: str,
        data_dir: Path,
        object_store: str,
        pacing: Pacing,
        *,
        peer_ssl: ssl.SSLContext | None = None,
    ) -> None:
        self.node = node
        self.peer_ssl = peer_ssl  # None: buddies are spoken to over plain HTTP
        self.pacing = pacing
        self.disk_root = data_dir / "ckpt"
        self.peer_root = data_dir / "ckpt-peer"
        self.object_url = object_store or (data_dir / "ckpt-objects").as_uri()
        # One disk tier for every rank: it removes unfinished writes once, at start (a
        # second instance's rescan would delete another rank's write in flight).
        self.disk = DiskTier(self.disk_root, name="nvme", pacing=pacing)
        self.peer_store = LocalFolderStore(self.peer_root)  # what buddies push to us
        self._objects: ObjectStore | None = None
        self._lock = threading.Lock()
        # (job, tier url) -> (when, the keys under JOB/): one listing for the node's ranks
        self._listings: dict[tuple[str, str], tuple[float, _Listing]] = {}

    def objects(self) -> ObjectStore:
        if self._objects is None:
            self._objects = open_store(self.object_url, pacing=self.pacing)
        return self._objects

    def for_plan(
        self, plan: wire.CkptPlan, names: list[str]
    ) -> tuple[dict[str, Tier], dict[str, str | None]]:
        """The tiers below RAM among ``names`` (the job's, nearest first), for one rank's
        engine, and the node holding each tier's copies (``None``: the object store)."""
        tiers: dict[str, Tier] = {}
        holder: dict[str, str | None] = {"ram": self.node, "nvme": self.node, "object": None}
        for name in names:
            if name == "nvme":
                tiers[name] = self.disk
            elif name == "peer" and plan.buddy is not None:
                tiers[name] = ObjectTier(
                    self.buddy_store(plan.buddy),
                    name="peer",
                    level=self.pacing.compress_level,
                    pacing=self.pacing,
                )
                holder["peer"] = plan.buddy.node
            elif name == "object":
                tiers[name] = ObjectTier(
                    self.objects(),
                    name="object",
                    level=self.pacing.compress_level,
                    pacing=self.pacing,
                )
        return tiers, holder

    def buddy_store(self, buddy: wire.PeerAddr) -> HttpPeerStore:
        """The objects a buddy node keeps for this one, over HTTP (HTTPS with ``peer_ssl``),
        reached with the credential for it that the supervisor put in ``buddy`` (none
        there: the buddy refuses every call, and says so)."""
        return HttpPeerStore(
            buddy.node,
            buddy.address,
            buddy.http_port,
            "" if buddy.token is None else buddy.token.get_secret_value(),
            as_node=self.node,
            ssl_context=self.peer_ssl,
        )

    def listing(self, job: str, tier: ObjectTier) -> list[str]:
        """The keys under ``JOB/`` at a remote tier, listed once for every rank of this
        node whose store starts within ``LISTING_TTL_S`` (each listing names every rank's
        shard of every step; a buddy that does not answer is waited for once, not once
        per rank). A failed listing fails the ranks waiting on it, and is not kept."""
        cache_key = (job, tier.store.url)
        now = time.monotonic()
        with self._lock:
            for stale in [k for k, (at, _) in self._listings.items() if now - at > LISTING_TTL_S]:
                del self._listings[stale]
            entry = self._listings.get(cache_key)
            owner = entry is None
            if entry is None:
                entry = (now, concurrent.futures.Future())
                self._listings[cache_key] = entry
        listing = entry[1]
        if owner:
            try:
                listing.set_result(tier.store.keys(f"{job}/"))
            except BaseException as exc:  # the ranks waiting on it get it; the next one lists
                listing.set_exception(exc)
                with self._lock:
                    if self._listings.get(cache_key) is entry:
                        del self._listings[cache_key]
                if not isinstance(exc, Exception):
                    raise
        return listing.result()

    def forget(self, job: str) -> None:
        """Drop the job's listings (it ended here)."""
        with self._lock:
            for listed in [k for k in self._listings if k[0] == job]:
                del self._listings[listed]

    def close(self) -> None:
        if self._objects is not None:
            with contextlib.suppress(Exception):
                self._objects.close()
