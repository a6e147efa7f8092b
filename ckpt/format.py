"""The shard format: one rank's state as bytes, on disk and on the wire.

A shard is safe to read from anywhere (a disk, a peer, an object store):
reading never unpickles and never evaluates; every header field is checked
before it is used. Layout, all integers little-endian::

    0            preamble, 32 bytes: magic b"PHXSHARD", version u32 (2),
                 header_nbytes u32, nbytes u64 (the whole shard), reserved u64 (0)
    32           header: UTF-8 JSON, header_nbytes bytes, then zeros up to
                 data_start, the next multiple of 64
    data_start   data: each tensor, array or bytes value at data_start + o,
                 o a multiple of 64, raw C-order little-endian bytes; zeros
                 between them; data_nbytes (a multiple of 64) in all
    nbytes - 32  trailer, 32 bytes: b"PHXSEAL\\0", nbytes u64, and the seal: the
                 xxh3-128 digest of the xxh3-128 digests of bytes [0, nbytes - 32)
                 in consecutive pieces of SEAL_CHUNK (64 MiB; the last one shorter)

The header is ``{"data": data_nbytes, "meta": {"job", "step", "rank"}, "tree": node}``.
In the tree, null, booleans, integers (any size), finite floats and strings
are themselves, and a JSON array is a ``list``. Every other value is an object
tagged by ``"t"``: ``tuple``/``size`` (torch.Size) ``{"v": [...]}``;
``dict``/``odict`` (OrderedDict) ``{"k": [...], "v": [...]}`` with keys
encoded as values (str, int, float, bool, None, tuples of those) and an
OrderedDict's ``_metadata`` (as ``state_dict()`` sets it) in ``"m"``;
``float`` ``{"bits": 16 hex digits}`` for nan and ±inf, bit-exact;
``tensor``/``param`` ``{"dtype", "shape", "o", "n"}`` (``param`` adds
``"grad"``: an ``nn.Parameter`` and its requires_grad); ``ndarray``/``npscalar``
likewise for numpy; ``bytes``/``bytearray`` ``{"o", "n"}``.

Kept: every bit of every value, tuple vs list, dict key types and order, the
same tensor object reached twice. Not kept: strides (tensors come back
contiguous), device (tensors come back on the CPU), ``requires_grad`` of a
plain tensor. Anything else (other objects, tensor subclasses, sparse or
quantized tensors, object arrays) is refused with ``UnsupportedValue`` when
planning, naming where it sits in the state.

Saving is ``plan`` (sizes everything up front, copies nothing) then
``write_into`` a preallocated buffer (one copy per tensor, device-to-host
included) then ``seal`` (the checksum, which can run later, off the training
path). ``decode`` returns tensors that are views of the buffer unless asked to
copy, each over a storage of exactly its own bytes; such views keep the buffer
exported (a shared-memory segment cannot be closed while they live). Given a
live state of the same structure (``into``), it copies each tensor into the
matching one there instead: a restore is then one copy into touched memory.

The seal is xxh3-128 (the ``xxhash`` package): the fastest of xxh3, blake3
and crc32c measured here, about 12 GB/s on one core, and it releases the GIL.
Hashed in 64 MiB pieces, a shard is verified on every core at once (a restore
waits for the verdict before it copies a byte into a live model); ``seal``
uses one thread, off the training path. Version 1 shards (one digest of the
whole body) are still read.
It detects corruption and torn writes, not tampering: a hostile sender can
seal anything, so reading is made safe by the checks, not by the checksum.
The tree codec lives in ``ckpt._tree``; this module owns the bytes around it.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import xxhash

from ckpt._limits import ALIGN, MAX_DEPTH, MAX_NDIM, Json, align, is_uint

if TYPE_CHECKING:  # torch is imported only where tensors are encoded or decoded
    from ckpt._tree import Blob
from ckpt.errors import (
    FormatError,
    ShardCorrupt,
    ShardMismatch,
    ShardRef,
    UnsafeShard,
    UnsupportedValue,
    UnsupportedVersion,
)

__all__ = [
    "ALIGN",
    "CHECKSUM_ALGORITHM",
    "MAX_DEPTH",
    "MAX_HEADER_NBYTES",
    "MAX_NDIM",
    "SEAL_CHUNK",
    "VERSION",
    "BufferLike",
    "Hasher",
    "ShardPlan",
    "checksum",
    "decode",
    "encode",
    "plan",
    "read_ref",
    "seal",
    "shard_nbytes",
    "verify",
    "write_into",
]

BufferLike: TypeAlias = bytes | bytearray | memoryview | mmap.mmap

MAGIC: Final = b"PHXSHARD"
SEAL_MAGIC: Final = b"PHXSEAL\x00"
VERSION: Final = 2
VERSIONS: Final = (1, 2)  # read; version 1 seals the whole body in one digest
SEAL_CHUNK: Final = 64 << 20
MAX_HEADER_NBYTES: Final = 64 << 20
CHECKSUM_ALGORITHM: Final = "xxh3_128"

_PREAMBLE: Final = struct.Struct("<8sIIQQ")
_TRAILER: Final = struct.Struct("<8sQ16s")
PREAMBLE_NBYTES: Final = _PREAMBLE.size
TRAILER_NBYTES: Final = _TRAILER.size


def _byte_view(buffer: BufferLike) -> memoryview:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("a shard buffer must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True, slots=True, eq=False)
class ShardPlan:
    """Everything about a shard but its data bytes: computed by ``plan``.

    ``nbytes`` is the exact size of the buffer ``write_into`` fills. The plan
    holds references to the state's tensors: write it before they change.
    """

    nbytes: int
    data_nbytes: int
    ref: ShardRef
    head: bytes = field(repr=False)  # preamble + header + padding, data_start bytes
    blobs: tuple[Blob, ...] = field(repr=False)


def plan(state: object, *, ref: ShardRef | None = None) -> ShardPlan:
    """Size a shard for ``state`` and build its header; copies no tensor data.

    ``ref``'s job, step and rank are recorded in the header. Raises
    ``UnsupportedValue`` naming the first value the format cannot store.
    """
    ref = ref if ref is not None else ShardRef()
    from ckpt._tree import TreeEncoder

    planner = TreeEncoder(ref)
    tree = planner.node(state, "state", 0)
    meta = {}
    for name, value, kind in (
        ("job", ref.job, str),
        ("step", ref.step, int),
        ("rank", ref.rank, int),
    ):
        if value is not None:
            if type(value) is not kind:
                raise UnsupportedValue(f"ShardRef.{name} must be a {kind.__name__}", ref=ref)
            meta[name] = value
    header = json.dumps(
        {"data": planner.cursor, "meta": meta, "tree": tree}, separators=(",", ":"), allow_nan=False
    ).encode("ascii")
    if len(header) > MAX_HEADER_NBYTES:
        raise UnsupportedValue(
            f"the header would be {len(header)} bytes, over the {MAX_HEADER_NBYTES}-byte limit "
            "(too many small values: group them into tensors)",
            ref=ref,
        )
    data_start = align(PREAMBLE_NBYTES + len(header))
    nbytes = data_start + planner.cursor + TRAILER_NBYTES
    preamble = _PREAMBLE.pack(MAGIC, VERSION, len(header), nbytes, 0)
    head = preamble + header + bytes(data_start - PREAMBLE_NBYTES - len(header))
    return ShardPlan(nbytes, planner.cursor, ref, head, tuple(planner.blobs))


def write_into(
    shard_plan: ShardPlan,
    buffer: BufferLike,
    *,
    defer: Callable[[Blob], bool] | None = None,
) -> list[Blob]:
    """Lay the planned shard into ``buffer`` (writable, exactly ``nbytes`` long).

    Each tensor lands with a single ``copy_`` (a device-to-host copy for a GPU
    tensor); gaps are zeroed so that the same state gives the same bytes. The
    trailer is left zeroed: the shard reads as unsealed until ``seal``.

    ``defer``: the blobs (tensors, arrays, bytes) it answers true for are not
    copied; they are returned, for the caller to copy to ``len(shard_plan.head)``
    plus their ``offset`` before the shard is sealed (``ckpt.lazy``'s copier).
    """
    view = _byte_view(buffer)
    if view.readonly:
        raise ValueError("write_into needs a writable buffer")
    if len(view) != shard_plan.nbytes:
        raise ValueError(f"buffer is {len(view)} bytes; the plan needs exactly {shard_plan.nbytes}")
    data_start = len(shard_plan.head)
    view[:data_start] = shard_plan.head
    from ckpt._tree import write_blobs

    pos, deferred = write_blobs(view, data_start, shard_plan.blobs, defer)
    view[pos:] = bytes(len(view) - pos)  # tail padding and the (unsealed) trailer
    return deferred


def encode(state: object, *, ref: ShardRef | None = None) -> bytearray:
    """``state`` as a sealed shard in a new bytearray (plan, write_into, seal)."""
    shard_plan = plan(state, ref=ref)
    buffer = bytearray(shard_plan.nbytes)
    write_into(shard_plan, buffer)
    seal(buffer)
    return buffer


# --------------------------------------------------------------------------- checksum


class Hasher:
    """The seal's digest of bytes fed in pieces of any size, as a stream brings them.

    It reads the format version from the preamble's first bytes and hashes as that
    version seals (``update``, ``digest`` and ``hexdigest`` like an ``xxhash`` object).
    Bytes that are no shard hash as version 2: they fail their check either way."""

    def __init__(self) -> None:
        self._head = b""
        self._chunked = True
        self._piece = xxhash.xxh3_128()
        self._piece_nbytes = 0
        self._digests: list[bytes] = []

    def update(self, data: BufferLike) -> None:
        view = _byte_view(data)
        if len(self._head) < PREAMBLE_NBYTES:
            self._head += bytes(view[: PREAMBLE_NBYTES - len(self._head)])
            if len(self._head) >= 12:
                self._chunked = _version_of(self._head) != 1
        if not self._chunked:
            self._piece.update(view)
            return
        while len(view):
            take = min(len(view), SEAL_CHUNK - self._piece_nbytes)
            self._piece.update(view[:take])
            self._piece_nbytes += take
            view = view[take:]
            if self._piece_nbytes == SEAL_CHUNK:
                self._digests.append(self._piece.digest())
                self._piece, self._piece_nbytes = xxhash.xxh3_128(), 0

    def digest(self) -> bytes:
        if not self._chunked:
            return self._piece.digest()
        last = [self._piece.digest()] if self._piece_nbytes or not self._digests else []
        return xxhash.xxh3_128(b"".join(self._digests + last)).digest()

    def hexdigest(self) -> str:
        return self.digest().hex()


def _version_of(head: BufferLike) -> int:
    view = _byte_view(head)
    if len(view) < 12 or bytes(view[:8]) != MAGIC:
        return VERSION
    return int.from_bytes(view[8:12], "little")


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="ckpt-verify"
            )
        return _pool


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _digest(body: memoryview, *, parallel: bool = True) -> bytes:
    """The seal of ``body`` (a shard without its trailer); its pieces hashed on every
    core when ``parallel`` (xxh3 releases the GIL)."""
    if _version_of(body) == 1:
        return xxhash.xxh3_128(body).digest()
    starts = range(0, max(len(body), 1), SEAL_CHUNK)

    def piece(start: int) -> bytes:
        return xxhash.xxh3_128(body[start : start + SEAL_CHUNK]).digest()

    if parallel and len(starts) > 1 and (os.cpu_count() or 1) > 1:
        digests = list(_hash_pool().map(piece, starts))
    else:
        digests = [piece(start) for start in starts]
    return xxhash.xxh3_128(b"".join(digests)).digest()


def _checksum_text(digest: bytes) -> str:
    return f"{CHECKSUM_ALGORITHM}:{digest.hex()}"


def checksum(buffer: BufferLike) -> str:
    """The checksum of a shard's content, every byte but the trailer.

    The text is ``"xxh3_128:<32 hex digits>"``: what ``seal`` records and what
    a catalog keeps. It is recomputed, never read from the trailer.
    """
    view = _byte_view(buffer)
    if len(view) < PREAMBLE_NBYTES + TRAILER_NBYTES:
        raise ValueError(f"{len(view)} bytes is too short to be a shard")
    return _checksum_text(_digest(view[: len(view) - TRAILER_NBYTES]))


def seal(buffer: BufferLike) -> str:
    """Write the trailer of a shard laid by ``write_into``; returns its checksum."""
    view = _byte_view(buffer)
    if view.readonly:
        raise ValueError("seal needs a writable buffer")
    _, nbytes = _read_preamble(view, ShardRef())
    if nbytes != len(view):
        raise ValueError(f"buffer is {len(view)} bytes but its preamble declares {nbytes}")
    body_end = nbytes - TRAILER_NBYTES
    digest = _digest(view[:body_end], parallel=False)  # off the training path: one core
    view[body_end:] = _TRAILER.pack(SEAL_MAGIC, nbytes, digest)
    return _checksum_text(digest)


def sealed_digest(buffer: BufferLike) -> bytes:
    """The digest a sealed shard's trailer records (not checked: see ``verify``)."""
    view = _byte_view(buffer)
    return bytes(_TRAILER.unpack_from(view, len(view) - TRAILER_NBYTES)[2])


def verify(buffer: BufferLike, expected: str | None = None, *, ref: ShardRef | None = None) -> str:
    """Check a shard's seal, and ``expected`` if given; returns the checksum.

    Raises ``ShardCorrupt`` saying what mismatched: the shard's length against
    its trailer (truncated or unsealed), its content against the trailer's
    digest, or the trailer's digest against ``expected`` (from a catalog).
    """
    return _verify_seal(_byte_view(buffer), expected, ref if ref is not None else ShardRef())


def _verify_seal(view: memoryview, expected: str | None, ref: ShardRef) -> str:
    if len(view) < PREAMBLE_NBYTES + TRAILER_NBYTES:
        raise ShardCorrupt(f"shard is {len(view)} bytes, too short to hold a trailer", ref=ref)
    body_end = len(view) - TRAILER_NBYTES
    magic, nbytes, recorded = _TRAILER.unpack_from(view, body_end)
    if magic != SEAL_MAGIC:
        raise ShardCorrupt(
            f"no seal trailer in the last {TRAILER_NBYTES} of {len(view)} bytes: "
            "the shard is truncated or was never sealed",
            ref=ref,
        )
    if nbytes != len(view):
        raise ShardCorrupt(f"shard is {len(view)} bytes but its trailer records {nbytes}", ref=ref)
    actual = _checksum_text(_digest(view[:body_end]))
    if actual != _checksum_text(recorded):
        raise ShardCorrupt(
            f"content hashes to {actual} but the trailer records {_checksum_text(recorded)}",
            ref=ref,
        )
    if expected is not None and expected != actual:
        raise ShardCorrupt(f"shard checksum is {actual} but {expected} was expected", ref=ref)
    return actual


# --------------------------------------------------------------------------- reading


def _refuse_pickle(head: bytes, ref: ShardRef) -> None:
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        raise UnsafeShard(
            f"refusing to read a pickle stream (protocol {head[1]}, as pickle and legacy "
            "torch.save write): Phalanx shards hold no pickle and are never unpickled",
            ref=ref,
        )
    if head.startswith(b"PK\x03\x04"):
        raise UnsafeShard(
            "refusing to read a zip archive (as torch.save writes, with a pickle inside): "
            "Phalanx shards hold no pickle and are never unpickled",
            ref=ref,
        )


def _read_preamble(view: memoryview, ref: ShardRef) -> tuple[int, int]:
    head = bytes(view[:PREAMBLE_NBYTES])
    if not MAGIC.startswith(head[: len(MAGIC)]):
        _refuse_pickle(head, ref)
        raise FormatError(
            f"not a Phalanx shard: it starts with {head[:8]!r}, not {MAGIC!r}", ref=ref
        )
    if len(head) < PREAMBLE_NBYTES:
        raise ShardCorrupt(f"shard is {len(view)} bytes, truncated inside its preamble", ref=ref)
    _, version, header_nbytes, nbytes, reserved = _PREAMBLE.unpack(head)
    if version not in VERSIONS:
        raise UnsupportedVersion(
            f"shard format version {version} is not supported (this reads "
            f"{', '.join(map(str, VERSIONS))})",
            ref=ref,
        )
    if reserved != 0:
        raise FormatError(f"preamble reserved field is {reserved:#x}, not 0", ref=ref)
    if not 2 <= header_nbytes <= MAX_HEADER_NBYTES:
        raise FormatError(
            f"header length {header_nbytes} is outside [2, {MAX_HEADER_NBYTES}]", ref=ref
        )
    data_start = align(PREAMBLE_NBYTES + header_nbytes)
    if nbytes < data_start + TRAILER_NBYTES or (nbytes - data_start - TRAILER_NBYTES) % ALIGN:
        raise FormatError(
            f"declared shard size {nbytes} does not fit a {header_nbytes}-byte header", ref=ref
        )
    return header_nbytes, nbytes


def _unique_keys(pairs: list[tuple[str, Json]]) -> dict[str, Json]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return out


def _reject_constant(name: str) -> Json:
    raise ValueError(f"{name} is not JSON")


@dataclass(frozen=True, slots=True)
class _Header:
    tree: Json
    data_start: int
    data_nbytes: int
    meta: ShardRef


def _read_header(view: memoryview, header_nbytes: int, nbytes: int, ref: ShardRef) -> _Header:
    end = PREAMBLE_NBYTES + header_nbytes
    if len(view) < end:
        raise ShardCorrupt(
            f"shard is {len(view)} bytes, truncated inside its {header_nbytes}-byte header", ref=ref
        )
    try:
        header = json.loads(
            bytes(view[PREAMBLE_NBYTES:end]).decode("utf-8"),
            parse_constant=_reject_constant,
            object_pairs_hook=_unique_keys,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"header is not valid JSON: {exc}", ref=ref) from exc
    if type(header) is not dict or set(header) != {"data", "meta", "tree"}:
        raise FormatError("header must be an object with exactly data, meta and tree", ref=ref)
    data_start = align(end)
    data_nbytes = header["data"]
    if not is_uint(data_nbytes) or data_start + data_nbytes + TRAILER_NBYTES != nbytes:
        raise FormatError(
            f"header data length {data_nbytes!r} does not match the shard size {nbytes}", ref=ref
        )
    meta = header["meta"]
    kinds = {"job": str, "step": int, "rank": int}
    if type(meta) is not dict or not set(meta) <= set(kinds):
        raise FormatError("header meta must be an object with at most job, step and rank", ref=ref)
    for name, value in meta.items():
        if type(value) is not kinds[name]:
            raise FormatError(f"header meta {name} must be a {kinds[name].__name__}", ref=ref)
    return _Header(header["tree"], data_start, data_nbytes, ShardRef(**meta))


def decode(
    buffer: BufferLike,
    *,
    copy: bool = False,
    verify: bool = True,
    expected: str | None = None,
    ref: ShardRef | None = None,
    into: object = None,
    fresh: list[str] | None = None,
) -> Any:
    """The state stored in a shard.

    Tensors and arrays are views of ``buffer`` (zero-copy) unless ``copy`` is
    set, for a buffer that will be reused; a read-only buffer (``bytes``, a
    read-only mmap) always gets copied tensors, since torch cannot guard
    read-only memory (numpy arrays stay read-only views). ``verify`` checks the
    seal first (and ``expected``, a catalog's checksum). ``ref`` names the
    shard in errors; its job, step and rank, where set, must match the header.
    Raises ``UnsafeShard`` for a pickle or ``torch.save`` file, ``FormatError``
    for any other invalid byte, ``ShardCorrupt`` and ``ShardMismatch``.

    ``into`` is a state of the same structure (the live model and optimizer
    state, say): each tensor or array whose place there holds one of the same
    type (tensor, ``nn.Parameter``, writable ndarray), dtype and shape is
    copied into that one (one copy, into memory already touched; onto its
    device, for a GPU tensor), and the returned state holds it; every other
    gets a new one, and its place (``tree['model']['w']``) is appended to
    ``fresh`` when given. Nothing in ``into`` is written unless the whole shard
    verifies and decodes.
    """
    ref = ref if ref is not None else ShardRef()
    view = _byte_view(buffer)
    header_nbytes, nbytes = _read_preamble(view, ref)
    if nbytes != len(view):
        raise ShardCorrupt(
            f"shard is {len(view)} bytes but its preamble declares {nbytes}", ref=ref
        )
    if verify:
        _verify_seal(view, expected, ref)
    header = _read_header(view, header_nbytes, nbytes, ref)
    for name in ("job", "step", "rank"):
        wanted, found = getattr(ref, name), getattr(header.meta, name)
        if wanted is not None and found is not None and wanted != found:
            raise ShardMismatch(
                f"shard is for {name} {found}, not {wanted}", ref=ref.merged(header.meta)
            )
    from ckpt._tree import TreeDecoder

    decoder = TreeDecoder(
        view, header.data_start, header.data_nbytes, copy, ref.merged(header.meta), into
    )
    state = decoder.decode(header.tree)
    if fresh is not None:
        fresh.extend(decoder.fresh)
    return state


def shard_nbytes(prefix: BufferLike) -> int:
    """The size a shard declares, from its first ``PREAMBLE_NBYTES`` bytes."""
    return _read_preamble(_byte_view(prefix), ShardRef())[1]


def read_ref(prefix: BufferLike, *, path: str | None = None) -> ShardRef:
    """The job, step and rank a shard's header records, from a prefix that
    covers its preamble and header (read data is not needed, nor checked)."""
    ref = ShardRef(path=path)
    view = _byte_view(prefix)
    header_nbytes, nbytes = _read_preamble(view, ref)
    return _read_header(view, header_nbytes, nbytes, ref).meta.merged(ref)
