"""The peer tier's transport: a buddy node's agent, spoken to over HTTP or HTTPS.

The peer tier is an ``ObjectTier`` (zstd on by default: the network is slower
than zstd) over ``HttpPeerStore``, an ``ObjectStore`` whose objects live in the
buddy agent's ``DATA_DIR/ckpt-peer`` folder, reached through its HTTP port
with this node's credential for that buddy (``token``, sent as the bearer token with
``X-Phalanx-Node: AS_NODE``): the supervisor derives it from the buddy's own agent
token and sends it inside the ``wire.PeerAddr`` it names the buddy with
(``phalanx.agent_tokens``); no other node's token is ever needed. Without
``as_node`` the token is presented alone, as the buddy's own token (the supervisor,
tests, tools). Over HTTPS when given an
``ssl_context`` (the buddy's certificate and its name or address verified against
it: an agent that serves TLS speaks TLS to its buddies). The buddy serves:

========  ===============================  =====================================
PUT       /v1/ckpt/peer/objects/{key}      store the body under ``key`` (temp
                                           name, fsync, rename)
GET       /v1/ckpt/peer/objects/{key}      the object; 404 when absent
GET       /v1/ckpt/peer/keys?prefix=P      JSON list of keys under ``P``
POST      /v1/ckpt/peer/delete             body ``{"keys": [...]}``
========  ===============================  =====================================

A key is ``JOB/STEP/rank-RANK.phx[.zst]``, ``JOB/STEP/manifest.json`` or a
manifest part ``JOB/STEP/manifest-rFIRST-rLAST.json``; the buddy refuses any
other (no path tricks). The buddy checks every shard it is
sent as it streams in (``SealCheck``: decompressed, its content must hash to
the digest its seal records), so a shard that lands at the peer tier is a
verified one; a mismatch is refused (422) and nothing is stored. A body, or
what it decompresses to, past the buddy's ``ckpt.peer_max_shard_bytes`` is
refused (413) as soon as it crosses the limit: zstd is decompressed in pieces
of at most ``DECOMPRESS_PIECE`` bytes, so a bomb never expands in memory.
Every call has a timeout; errors are ``OSError``s that ``ObjectTier`` turns
into a ``TierError`` naming the URL.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import ssl
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import IO, Final, cast
from urllib.parse import quote

import pydantic_core
import zstandard

from ckpt.errors import ObjectTooLarge, PeerError
from ckpt.format import (
    CHECKSUM_ALGORITHM,
    PREAMBLE_NBYTES,
    SEAL_MAGIC,
    TRAILER_NBYTES,
    BufferLike,
    Hasher,
    shard_nbytes,
)
from ckpt.stores import MAX_GET_NBYTES, PART_NBYTES, ObjectStore

__all__ = ["PEER_KEY_RE", "HttpPeerStore", "PeerError", "SealCheck"]

DECOMPRESS_PIECE: Final = 1 << 20  # SealCheck's largest piece of decompressed output
NODE_HEADER: Final = "X-Phalanx-Node"  # phalanx.agent_tokens.NODE_HEADER (ckpt needs no phalanx)
_ANSWER_NBYTES: Final = 1 << 16  # the most of a buddy's short JSON answer ever read

PEER_KEY_RE: Final = re.compile(
    r"^[a-z0-9][a-z0-9-]{0,80}/\d{12}/"
    r"(rank-\d{5}\.phx(\.zst)?|manifest\.json|manifest-r\d{5}-r\d{5}\.json)$"
)


class SealCheck:
    """Checks a shard's seal while it streams in (zstd-compressed or not): every byte but
    the trailer hashed, the trailer's length and digest compared at the end.

    Compressed input is decompressed in pieces of at most ``DECOMPRESS_PIECE`` bytes
    (a zstd bomb never expands in memory), and ``feed`` raises ``ObjectTooLarge`` as
    soon as the content passes ``max_nbytes`` (``None``: no limit) or the size the
    shard's preamble declares (``declared``, known from its first ``PREAMBLE_NBYTES``
    bytes, themselves checked: a preamble that is not a shard's is a ``FormatError``
    at once, and one declaring more than ``max_nbytes`` an ``ObjectTooLarge``)."""

    def __init__(
        self, compressed: bool, max_nbytes: int | None = None, what: str = "the shard"
    ) -> None:
        self.max_nbytes = max_nbytes
        self.what = what
        self.hasher = Hasher()
        self.tail = b""
        self.total = 0
        self.head = b""  # the content's first PREAMBLE_NBYTES bytes, until they are read
        self.declared: int | None = None
        self.writer = (
            zstandard.ZstdDecompressor().stream_writer(
                cast(IO[bytes], _Sink(self._take)),
                write_size=DECOMPRESS_PIECE,
                write_return_read=True,
            )
            if compressed
            else None
        )

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self.writer is not None:
            self.writer.write(data)  # calls _take with each decompressed piece
        else:
            self._take(data)

    def _take(self, data: BufferLike) -> None:
        what = f"{self.what} (decompressed)" if self.writer else self.what
        if self.declared is None:
            self._read_preamble(data, what)
        if self.declared is not None and self.total + len(data) > self.declared:
            raise ObjectTooLarge(what, self.declared, " its preamble declares")
        if self.max_nbytes is not None and self.total + len(data) > self.max_nbytes:
            raise ObjectTooLarge(what, self.max_nbytes)
        self.total += len(data)
        if len(data) >= TRAILER_NBYTES:  # hash what was held back and all but the new tail,
            view = memoryview(data)  # never joining them: a piece may be 8 MiB
            self.hasher.update(self.tail)
            self.hasher.update(view[:-TRAILER_NBYTES])
            self.tail = bytes(view[-TRAILER_NBYTES:])
            return
        pending = self.tail + data
        if len(pending) > TRAILER_NBYTES:
            self.hasher.update(pending[:-TRAILER_NBYTES])
            pending = pending[-TRAILER_NBYTES:]
        self.tail = pending

    def _read_preamble(self, data: BufferLike, what: str) -> None:
        self.head += bytes(memoryview(data)[: PREAMBLE_NBYTES - len(self.head)])
        if len(self.head) < PREAMBLE_NBYTES:
            return
        self.declared = shard_nbytes(self.head)  # a FormatError when it is no shard's
        if self.max_nbytes is not None and self.declared > self.max_nbytes:
            raise ObjectTooLarge(what, self.max_nbytes, f" (its preamble declares {self.declared})")

    def problem(self) -> str | None:
        """Why the shard is not whole and sealed, or ``None`` when it is."""
        if len(self.tail) < TRAILER_NBYTES:
            return f"{self.total} bytes is too short to be a shard"
        magic, nbytes, digest = struct.unpack("<8sQ16s", self.tail)
        if magic != SEAL_MAGIC or nbytes != self.total:
            return f"no seal for {self.total} bytes: truncated or never sealed"
        if self.hasher.digest() != digest:
            return (
                f"content hashes to {CHECKSUM_ALGORITHM}:{self.hasher.hexdigest()}, not the "
                f"sealed {CHECKSUM_ALGORITHM}:{digest.hex()}"
            )
        return None


class _Sink:
    """The file a zstd stream writer writes its decompressed pieces to."""

    def __init__(self, take: Callable[[bytes], None]) -> None:
        self.take = take

    def write(self, data: bytes) -> int:
        self.take(data)
        return len(data)


class HttpPeerStore(ObjectStore):
    """Objects on a buddy agent; see the module docstring."""

    parts_in_turn = True  # put_stream sends each part before it asks for the next

    def __init__(
        self,
        node: str,
        address: str,
        port: int,
        token: str,
        *,
        as_node: str | None = None,
        timeout_s: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.node = node
        self.address = address
        self.port = port
        self._token = token  # not in any repr
        self.as_node = as_node
        self.timeout_s = timeout_s
        self.ssl_context = ssl_context
        scheme = "https" if ssl_context is not None else "http"
        self.url = f"{scheme}://{address}:{port}/v1/ckpt/peer/objects/"

    def _conn(self) -> http.client.HTTPConnection:
        if self.ssl_context is not None:
            return http.client.HTTPSConnection(
                self.address, self.port, timeout=self.timeout_s, context=self.ssl_context
            )
        return http.client.HTTPConnection(self.address, self.port, timeout=self.timeout_s)

    def _headers(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self._token}"}
        if self.as_node is not None:
            headers[NODE_HEADER] = self.as_node
        return headers

    def _check(self, resp: http.client.HTTPResponse, what: str) -> None:
        if resp.status == 404:
            resp.read(_ANSWER_NBYTES)
            raise FileNotFoundError(f"{what}: not on peer {self.node}")
        if resp.status >= 300:
            body = resp.read(500).decode(errors="replace")
            raise PeerError(f"{what}: peer {self.node} answered {resp.status}: {body}")

    def put_stream(self, key: str, parts: Iterable[BufferLike]) -> None:
        conn = self._conn()
        try:
            try:
                conn.putrequest("PUT", "/v1/ckpt/peer/objects/" + quote(key))
                for name, value in {
                    **self._headers(),
                    "Transfer-Encoding": "chunked",
                    "Content-Type": "application/octet-stream",
                }.items():
                    conn.putheader(name, value)
                conn.endheaders()
                # Chunked by hand: http.client's encode_chunked joins each part and its
                # framing into new bytes, two copies and fresh memory per part (2.0 s of
                # CPU per GiB on loopback here, 0.3 s without); this sends the part itself.
                for part in parts:
                    view = memoryview(part).cast("B")
                    if len(view):  # an empty chunk would end the body
                        conn.send(b"%X\r\n" % len(view))
                        conn.send(view)
                        conn.send(b"\r\n")
                conn.send(b"0\r\n\r\n")
            except OSError as exc:
                # The buddy may have refused the body part-way (413): say why, if it did.
                answer = None
                with contextlib.suppress(OSError, http.client.HTTPException):
                    answer = conn.getresponse()
                if answer is not None:
                    self._check(answer, f"PUT {key}")
                raise PeerError(f"PUT {key}: sending to peer {self.node} failed: {exc}") from exc
            resp = conn.getresponse()
            self._check(resp, f"PUT {key}")
            resp.read(_ANSWER_NBYTES)
        finally:
            conn.close()

    def get_stream(self, key: str) -> Iterator[bytes]:
        conn = self._conn()
        try:
            conn.request("GET", "/v1/ckpt/peer/objects/" + quote(key), headers=self._headers())
            resp = conn.getresponse()
            self._check(resp, f"GET {key}")
            announced = resp.length
            while piece := resp.read(PART_NBYTES):
                yield piece
            # http.client ends a body cut short without an error: a buddy that restarted
            # mid-answer must read as a failed transfer, never as a short (corrupt) copy.
            if resp.length:
                raise PeerError(
                    f"GET {key}: peer {self.node} closed the connection "
                    f"{resp.length} bytes short of the {announced} it announced"
                )
        finally:
            conn.close()

    def keys(self, prefix: str) -> list[str]:
        conn = self._conn()
        try:
            conn.request(
                "GET", "/v1/ckpt/peer/keys?prefix=" + quote(prefix), headers=self._headers()
            )
            resp = conn.getresponse()
            self._check(resp, f"listing {prefix}")
            body = resp.read(MAX_GET_NBYTES + 1)
            if len(body) > MAX_GET_NBYTES:
                raise ObjectTooLarge(
                    f"the listing of {prefix} from peer {self.node}", MAX_GET_NBYTES
                )
            try:  # jiter: a listing nested past 200 levels is a ValueError, no recursion
                found = pydantic_core.from_json(body, allow_inf_nan=False)
            except ValueError as exc:
                raise PeerError(f"listing {prefix}: peer {self.node} sent no JSON: {exc}") from exc
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
            conn.request(
                "POST",
                "/v1/ckpt/peer/delete",
                body=json.dumps({"keys": keys}),
                headers={**self._headers(), "Content-Type": "application/json"},
            )
            resp = conn.getresponse()
            self._check(resp, f"deleting {len(keys)} keys")
            resp.read(_ANSWER_NBYTES)
        finally:
            conn.close()
