"""The peer tier's transport: a buddy node's agent, spoken to over HTTP.

The peer tier is an ``ObjectTier`` (zstd on by default: the network is slower
than zstd) over ``HttpPeerStore``, an ``ObjectStore`` whose objects live in the
buddy agent's ``DATA_DIR/ckpt-peer`` folder, reached through its HTTP port
with the fleet's agent token (``http.token_file``). The buddy serves:

========  ===============================  =====================================
PUT       /v1/ckpt/peer/objects/{key}      store the body under ``key`` (temp
                                           name, fsync, rename)
GET       /v1/ckpt/peer/objects/{key}      the object; 404 when absent
GET       /v1/ckpt/peer/keys?prefix=P      JSON list of keys under ``P``
POST      /v1/ckpt/peer/delete             body ``{"keys": [...]}``
========  ===============================  =====================================

A key is ``JOB/STEP/rank-RANK.phx[.zst]`` or ``JOB/STEP/manifest.json``; the
buddy refuses any other (no path tricks). The buddy checks every shard it is
sent as it streams in (``SealCheck``: decompressed, its content must hash to
the digest its seal records), so a shard that lands at the peer tier is a
verified one; a mismatch is refused (422) and nothing is stored. Every call has a timeout; errors
are ``OSError``s that ``ObjectTier`` turns into a ``TierError`` naming the URL.
"""

from __future__ import annotations

import http.client
import json
import re
import struct
from collections.abc import Iterable, Iterator
from typing import Final
from urllib.parse import quote

import xxhash
import zstandard

from ckpt.format import CHECKSUM_ALGORITHM, SEAL_MAGIC, TRAILER_NBYTES
from ckpt.objects import PART_NBYTES, ObjectStore

__all__ = ["PEER_KEY_RE", "HttpPeerStore", "SealCheck"]

PEER_KEY_RE: Final = re.compile(
    r"^[a-z0-9][a-z0-9-]{0,80}/\d{12}/(rank-\d{5}\.phx(\.zst)?|manifest\.json)$"
)


class SealCheck:
    """Checks a shard's seal while it streams in (zstd-compressed or not): every byte but
    the trailer hashed, the trailer's length and digest compared at the end."""

    def __init__(self, compressed: bool) -> None:
        self.decompressor = zstandard.ZstdDecompressor().decompressobj() if compressed else None
        self.hasher = xxhash.xxh3_128()
        self.tail = b""
        self.total = 0

    def feed(self, data: bytes) -> None:
        if self.decompressor is not None:
            data = self.decompressor.decompress(data)
        self.total += len(data)
        pending = self.tail + data
        if len(pending) > TRAILER_NBYTES:
            self.hasher.update(pending[:-TRAILER_NBYTES])
            pending = pending[-TRAILER_NBYTES:]
        self.tail = pending

    def problem(self) -> str | None:
        """Why the shard is not whole and sealed, or ``None`` when it is."""
        if len(self.tail) < TRAILER_NBYTES:
            return f"{self.total} bytes is too short to be a shard"
        magic, nbytes, digest = struct.unpack("<8sQ16s", self.tail)
        if magic != SEAL_MAGIC or nbytes != self.total:
            return f"no seal for {self.total} bytes: truncated or never sealed"
        if self.hasher.digest() != digest:
            return (f"content hashes to {CHECKSUM_ALGORITHM}:{self.hasher.hexdigest()}, not the "
                    f"sealed {CHECKSUM_ALGORITHM}:{digest.hex()}")
        return None


class PeerError(OSError):
    """The buddy answered with an error or not at all."""


class HttpPeerStore(ObjectStore):
    """Objects on a buddy agent; see the module docstring."""

    def __init__(self, node: str, address: str, port: int, token: str, *,
                 timeout_s: float = 60.0) -> None:  # fmt: skip
        self.node = node
        self.address = address
        self.port = port
        self.token = token
        self.timeout_s = timeout_s
        self.url = f"http://{address}:{port}/v1/ckpt/peer/objects/"

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.address, self.port, timeout=self.timeout_s)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def _check(self, resp: http.client.HTTPResponse, what: str) -> None:
        if resp.status == 404:
            resp.read()
            raise FileNotFoundError(f"{what}: not on peer {self.node}")
        if resp.status >= 300:
            body = resp.read(500).decode(errors="replace")
            raise PeerError(f"{what}: peer {self.node} answered {resp.status}: {body}")

    def put_stream(self, key: str, parts: Iterable[bytes]) -> None:
        conn = self._conn()
        try:
            conn.request("PUT", "/v1/ckpt/peer/objects/" + quote(key), body=_nonempty(parts),
                         headers={**self._headers(), "Content-Type": "application/octet-stream"},
                         encode_chunked=True)  # fmt: skip
            resp = conn.getresponse()
            self._check(resp, f"PUT {key}")
            resp.read()
        finally:
            conn.close()

    def get_stream(self, key: str) -> Iterator[bytes]:
        conn = self._conn()
        try:
            conn.request("GET", "/v1/ckpt/peer/objects/" + quote(key), headers=self._headers())
            resp = conn.getresponse()
            self._check(resp, f"GET {key}")
            while piece := resp.read(PART_NBYTES):
                yield piece
        finally:
            conn.close()

    def keys(self, prefix: str) -> list[str]:
        conn = self._conn()
        try:
            conn.request("GET", "/v1/ckpt/peer/keys?prefix=" + quote(prefix),
                         headers=self._headers())  # fmt: skip
            resp = conn.getresponse()
            self._check(resp, f"listing {prefix}")
            found = json.loads(resp.read())
        finally:
            conn.close()
        if not isinstance(found, list) or not all(isinstance(k, str) for k in found):
            raise PeerError(f"listing {prefix}: peer {self.node} sent no list of keys")
        return found

    def delete(self, keys: list[str]) -> None:
        if not keys:
            return
        conn = self._conn()
        try:
            conn.request("POST", "/v1/ckpt/peer/delete", body=json.dumps({"keys": keys}),
                         headers={**self._headers(), "Content-Type": "application/json"})
            resp = conn.getresponse()
            self._check(resp, f"deleting {len(keys)} keys")
            resp.read()
        finally:
            conn.close()


def _nonempty(parts: Iterable[bytes]) -> Iterator[bytes]:
    # http.client ends a chunked body at the first empty chunk: never send one early.
    for part in parts:
        if part:
            yield part
