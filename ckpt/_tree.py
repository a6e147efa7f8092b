"""The state tree codec: a nested state as header JSON plus raw data blobs.

``TreeEncoder`` turns a state into the header's ``tree`` and the list of blobs
(tensors, arrays, bytes) with their offsets in the data region;
``write_blobs`` copies them there; ``TreeDecoder`` rebuilds the state from an
untrusted tree, checking every node, and can copy tensors and arrays into the
matching ones of a live state (``into``) instead of allocating new ones. The
node kinds are listed in ``ckpt.format``'s docstring, which owns the byte
layout around them.
"""

from __future__ import annotations

import importlib
import math
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from typing import Any, Final

import torch

from ckpt._limits import ALIGN, MAX_DEPTH, MAX_NDIM, Json, align, is_uint
from ckpt.errors import CheckpointError, FormatError, ShardRef, UnsupportedValue

TORCH_DTYPE_NAMES: Final = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)
TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    name: dtype
    for name in TORCH_DTYPE_NAMES
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
TORCH_NAMES: Final = {dtype: name for name, dtype in TORCH_DTYPES.items()}
NUMPY_DTYPES: Final = frozenset(
    (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
)
BLOB_TAGS: Final = frozenset(("tensor", "param", "ndarray", "npscalar", "bytes", "bytearray"))


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True, slots=True)
class Blob:
    kind: str  # "tensor", "ndarray" or "bytes"
    value: Any
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from data_start
    nbytes: int


class TreeEncoder:
    """Turns a state into a tree of JSON nodes, assigning each blob its offset."""

    def __init__(self, ref: ShardRef) -> None:
        self.ref = ref
        self.blobs: list[Blob] = []
        self.cursor = 0
        self.seen: dict[int, dict[str, Json]] = {}
        self.np: Any = sys.modules.get("numpy")

    def refuse(self, where: str, why: str) -> UnsupportedValue:
        return UnsupportedValue(f"cannot store {where}: {why}", ref=self.ref)

    def blob(self, kind: str, value: Any, dtype: str, shape: tuple[int, ...], n: int) -> int:
        offset = self.cursor
        self.blobs.append(Blob(kind, value, dtype, shape, offset, n))
        self.cursor = align(offset + n)
        return offset

    def node(self, value: object, where: str, depth: int) -> Json:
        if value is None or type(value) in (bool, int, str):
            return value
        if type(value) is float:
            if math.isfinite(value):
                return value
            return {"t": "float", "bits": struct.pack("<d", value).hex()}
        if isinstance(value, list | tuple | dict) and depth >= MAX_DEPTH:
            raise self.refuse(where, f"nested deeper than {MAX_DEPTH} levels (a cycle?)")
        if type(value) is list:
            return [self.node(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        if type(value) is tuple or type(value) is torch.Size:
            tag = "tuple" if type(value) is tuple else "size"
            return {
                "t": tag,
                "v": [self.node(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)],
            }
        if type(value) is dict or type(value) is OrderedDict:
            return self.mapping(value, where, depth)
        if isinstance(value, torch.Tensor):
            return self.tensor(value, where)
        if type(value) is bytes or type(value) is bytearray:
            tag = type(value).__name__
            return {
                "t": tag,
                "o": self.blob("bytes", value, "uint8", (len(value),), len(value)),
                "n": len(value),
            }
        np = self.np
        if np is not None and (type(value) is np.ndarray or isinstance(value, np.generic)):
            return self.array(value, where)
        raise self.refuse(
            where, f"a {type(value).__module__}.{type(value).__qualname__} is not a supported value"
        )

    def mapping(self, value: dict[Any, Any], where: str, depth: int) -> Json:
        keys, values = [], []
        for k, v in value.items():
            at = f"{where}[{k!r}]"
            keys.append(self.key(k, at, depth + 1))
            values.append(self.node(v, at, depth + 1))
        if type(value) is dict:
            return {"t": "dict", "k": keys, "v": values}
        out = {"t": "odict", "k": keys, "v": values}
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:
            out["m"] = self.node(metadata, f"{where}._metadata", depth + 1)
        return out

    def key(self, key: object, where: str, depth: int) -> Json:
        if type(key) is tuple:
            if depth >= MAX_DEPTH:
                raise self.refuse(where, f"a key nested deeper than {MAX_DEPTH} levels")
            return {"t": "tuple", "v": [self.key(k, where, depth + 1) for k in key]}
        if key is None or type(key) in (bool, int, float, str):
            return self.node(key, where, depth)
        kinds = "str, int, float, bool, None or tuples of them"
        raise self.refuse(where, f"a dict key of type {type(key).__qualname__} (keys are {kinds})")

    def tensor(self, value: torch.Tensor, where: str) -> Json:
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise self.refuse(where, f"tensor subclass {type(value).__qualname__}")
        if value.layout != torch.strided or value.is_quantized or value.is_nested:
            raise self.refuse(where, "only dense tensors, not sparse, quantized or nested ones")
        if value.device.type == "meta":
            raise self.refuse(where, "a meta tensor has no data")
        dtype = TORCH_NAMES.get(value.dtype)
        if dtype is None:
            raise self.refuse(where, f"dtype {value.dtype} is not in the format's allow-list")
        if (known := self.seen.get(id(value))) is not None:
            return known
        shape = tuple(value.shape)
        n = value.numel() * value.element_size()
        offset = self.blob("tensor", value, dtype, shape, n)
        out: dict[str, Json] = {"t": "tensor", "dtype": dtype, "shape": list(shape)}
        out.update(o=offset, n=n)
        if type(value) is torch.nn.Parameter:
            out["t"], out["grad"] = "param", value.requires_grad
        self.seen[id(value)] = out
        return out

    def array(self, value: Any, where: str) -> Json:
        dtype = value.dtype.name
        if dtype not in NUMPY_DTYPES or value.dtype.fields is not None:
            raise self.refuse(
                where, f"numpy dtype {value.dtype!s} is not in the format's allow-list"
            )
        if (known := self.seen.get(id(value))) is not None:
            return known
        scalar = type(value) is not self.np.ndarray
        array = self.np.asarray(value)
        shape, n = tuple(array.shape), int(array.nbytes)
        offset = self.blob("ndarray", array, dtype, shape, n)
        out: dict[str, Json] = {"t": "npscalar", "dtype": dtype, "o": offset, "n": n}
        if not scalar:
            out["t"], out["shape"] = "ndarray", list(shape)
            self.seen[id(value)] = out
        return out


def write_blobs(
    view: memoryview,
    data_start: int,
    blobs: tuple[Blob, ...],
    defer: Callable[[Blob], bool] | None = None,
) -> tuple[int, list[Blob]]:
    """Copy each blob to ``data_start`` + its offset, zeroing the gaps; returns the end
    and the blobs ``defer`` held back (their bytes left for the caller to copy)."""
    base = torch.frombuffer(view, dtype=torch.uint8)
    pos = data_start
    deferred: list[Blob] = []
    with torch.no_grad():
        for blob in blobs:
            start = data_start + blob.offset
            if start > pos:
                view[pos:start] = bytes(start - pos)
            pos = max(pos, start + blob.nbytes)
            if blob.nbytes == 0:
                continue
            if defer is not None and defer(blob):
                deferred.append(blob)
                continue
            if blob.kind == "tensor":
                dst = base[start : start + blob.nbytes].view(TORCH_DTYPES[blob.dtype])
                dst.view(blob.shape).copy_(blob.value)
            elif blob.kind == "ndarray":
                np: Any = sys.modules["numpy"]
                count = blob.nbytes // np.dtype(blob.dtype).itemsize
                dst = np.frombuffer(view, np.dtype(blob.dtype).newbyteorder("<"), count, start)
                np.copyto(dst.reshape(blob.shape), blob.value, casting="equiv")
            else:
                view[start : start + blob.nbytes] = blob.value
    return pos, deferred


def _child(target: object, key: object) -> object:
    """What ``into`` holds where the shard's tree holds ``key`` (``None``: nothing)."""
    if isinstance(target, Mapping):
        try:
            return target.get(key)
        except TypeError:  # a key the mapping cannot hash or compare
            return None
    if type(target) in (list, tuple) and type(key) is int and key < len(target):  # type: ignore[arg-type]
        return target[key]  # type: ignore[index]
    return None


class TreeDecoder:
    """Rebuilds a state from a validated header's tree; checks every node.

    With ``into`` (a state of the same structure, say the live model and
    optimizer state), a tensor or array whose place in ``into`` holds one of
    the same type, dtype and shape is copied into that one and returned; any
    other gets a new one, and its place is listed in ``fresh``. The copies run
    in ``finish``, once the whole tree is valid, so a shard that fails to
    decode leaves ``into`` untouched.
    """

    def __init__(
        self,
        view: memoryview,
        data_start: int,
        data_nbytes: int,
        copy: bool,
        ref: ShardRef,
        into: object = None,
    ) -> None:
        self.view = view
        self.data_start = data_start
        self.data_nbytes = data_nbytes
        self.copy = copy
        self.ref = ref
        self.high_water = 0
        self.shared: dict[int, tuple[tuple[Json, ...], object]] = {}
        self.into = into
        self.copies: list[Callable[[], None]] = []
        self.fresh: list[str] = []

    def decode(self, tree: Json) -> Any:
        """The state; with ``into``, its matching tensors filled from the shard."""
        state = self.node(tree, "tree", 0, self.into)
        self.finish()
        return state

    def finish(self) -> None:
        """Copy into ``into``'s tensors and arrays (the tree is valid by now)."""
        copies, self.copies = self.copies, []
        with torch.no_grad():
            for copy in copies:
                copy()

    def bad(self, where: str, why: str) -> FormatError:
        return FormatError(f"header field {where}: {why}", ref=self.ref)

    def fields(
        self,
        node: dict[str, Json],
        where: str,
        required: set[str],
        optional: Set[str] = frozenset(),
    ) -> None:
        keys = set(node)
        if not required <= keys <= required | optional:
            raise self.bad(
                where, f"a {node['t']!r} node has keys {sorted(keys)}, expected {sorted(required)}"
            )

    def list_field(self, node: dict[str, Json], name: str, where: str) -> list[Json]:
        value = node[name]
        if type(value) is not list:
            raise self.bad(where, f"{name!r} must be an array")
        return value

    def node(self, node: Json, where: str, depth: int, target: object = None) -> Any:
        if node is None or type(node) in (bool, int, float, str):
            return node
        if depth >= MAX_DEPTH:
            raise self.bad(where, f"nested deeper than {MAX_DEPTH} levels")
        if type(node) is list:
            return [
                self.node(v, f"{where}[{i}]", depth + 1, _child(target, i))
                for i, v in enumerate(node)
            ]
        tag = node.get("t") if type(node) is dict else None
        if type(tag) is not str:
            raise self.bad(where, "an object node needs a string tag t")
        if tag == "float":
            return self.float_bits(node, where)
        if tag in ("tuple", "size"):
            self.fields(node, where, {"t", "v"})
            items = [
                self.node(v, f"{where}[{i}]", depth + 1, _child(target, i))
                for i, v in enumerate(self.list_field(node, "v", where))
            ]
            if tag == "size" and not all(is_uint(i) and i < 1 << 63 for i in items):
                raise self.bad(where, "a torch.Size holds non-negative integers only")
            return tuple(items) if tag == "tuple" else torch.Size(items)
        if tag in ("dict", "odict"):
            return self.mapping(node, where, depth, target)
        if tag in BLOB_TAGS:
            return self.blob(node, where, target)
        raise self.bad(where, f"unknown node {short(tag)}")

    def float_bits(self, node: dict[str, Json], where: str) -> float:
        self.fields(node, where, {"t", "bits"})
        bits = node["bits"]
        if (
            type(bits) is not str
            or len(bits) != 16
            or not all(c in "0123456789abcdef" for c in bits)
        ):
            raise self.bad(where, "float bits must be 16 lowercase hex digits")
        value: float = struct.unpack("<d", bytes.fromhex(bits))[0]
        return value

    def key(self, node: Json, where: str, depth: int) -> object:
        if node is None or type(node) in (bool, int, float, str):
            return node
        tag = node.get("t") if type(node) is dict else None
        if tag == "float":
            return self.float_bits(node, where)
        if tag == "tuple" and depth < MAX_DEPTH:
            self.fields(node, where, {"t", "v"})
            return tuple(self.key(k, where, depth + 1) for k in self.list_field(node, "v", where))
        raise self.bad(where, "a dict key must be a str, int, float, bool, None or a tuple of them")

    def mapping(
        self, node: dict[str, Json], where: str, depth: int, target: object = None
    ) -> dict[Any, Any]:
        tag = node["t"]
        self.fields(node, where, {"t", "k", "v"}, {"m"} if tag == "odict" else set())
        keys = [
            self.key(k, f"{where}.k[{i}]", depth + 1)
            for i, k in enumerate(self.list_field(node, "k", where))
        ]
        values = self.list_field(node, "v", where)
        if len(keys) != len(values):
            raise self.bad(where, f"{len(keys)} keys but {len(values)} values")
        out: dict[Any, Any] = {} if tag == "dict" else OrderedDict()
        for k, v in zip(keys, values, strict=True):
            if k in out:
                raise self.bad(where, f"duplicate key {k!r}")
            out[k] = self.node(v, f"{where}[{short(k)}]", depth + 1, _child(target, k))
        if "m" in node:
            metadata = self.node(node["m"], f"{where}._metadata", depth + 1)
            if not isinstance(metadata, dict):
                raise self.bad(where, "_metadata must be a mapping")
            out._metadata = metadata  # type: ignore[attr-defined]
        return out

    def region(self, node: dict[str, Json], where: str, itemsize: int, shape: list[int]) -> int:
        offset, n = node["o"], node["n"]
        if not (is_uint(offset) and is_uint(n)):
            raise self.bad(where, "o and n must be non-negative integers")
        if offset % ALIGN:
            raise self.bad(where, f"offset {offset} is not a multiple of {ALIGN}")
        if offset + n > self.data_nbytes:
            raise self.bad(
                where,
                f"bytes [{offset}, {offset + n}) run past the {self.data_nbytes}-byte data region",
            )
        numel = 1
        for dim in shape:
            numel *= dim
        if numel * itemsize != n:
            raise self.bad(where, f"shape {shape} of {itemsize}-byte items is not {n} bytes")
        start: int = self.data_start + offset
        return start

    def shape(self, node: dict[str, Json], where: str) -> list[int]:
        shape = node["shape"]
        if (
            type(shape) is not list
            or len(shape) > MAX_NDIM
            or not all(is_uint(d) and d < 1 << 63 for d in shape)
        ):
            raise self.bad(where, f"shape must be at most {MAX_NDIM} non-negative integers")
        return shape

    def blob(self, node: dict[str, Json], where: str, target: object = None) -> Any:
        tag = node["t"]
        if tag in ("bytes", "bytearray"):
            self.fields(node, where, {"t", "o", "n"})
            start = self.region(node, where, 1, [node["n"]])
            return self.claim(
                node,
                where,
                lambda: (bytes if tag == "bytes" else bytearray)(
                    self.view[start : start + node["n"]]
                ),
            )
        optional = {"grad"} if tag == "param" else set()
        self.fields(
            node,
            where,
            {"t", "dtype", "o", "n"} | ({"shape"} if tag != "npscalar" else set()),
            optional,
        )
        shape = self.shape(node, where) if tag != "npscalar" else []
        if tag in ("tensor", "param"):
            dtype = TORCH_DTYPES.get(node["dtype"]) if type(node["dtype"]) is str else None
            if dtype is None:
                raise self.bad(where, f"dtype {short(node['dtype'])} is not in the allow-list")
            start = self.region(node, where, dtype.itemsize, shape)
            grad = node.get("grad", False)
            if type(grad) is not bool or (
                grad and not (dtype.is_floating_point or dtype.is_complex)
            ):
                raise self.bad(
                    where, "grad must be a boolean, true only for a float or complex dtype"
                )
            return self.claim(
                node,
                where,
                lambda: self.tensor(dtype, shape, start, node["n"], where, tag, grad, target),
            )
        if node["dtype"] not in NUMPY_DTYPES:
            raise self.bad(where, f"numpy dtype {short(node['dtype'])} is not in the allow-list")
        np: Any = _numpy(self.ref)
        dtype_np = np.dtype(node["dtype"]).newbyteorder("<")
        start = self.region(node, where, dtype_np.itemsize, shape)
        return self.claim(
            node,
            where,
            lambda: self.array(np, dtype_np, shape, start, node["n"], where, tag, target),
        )

    def claim(self, node: dict[str, Json], where: str, make: Any) -> Any:
        """Regions are disjoint and in order, except one value reached twice."""
        offset, n = node["o"], node["n"]
        if n == 0:
            return make()
        descriptor = tuple(sorted((k, str(v)) for k, v in node.items()))
        if (known := self.shared.get(offset)) is not None:
            if known[0] != descriptor:
                raise self.bad(
                    where, f"bytes at offset {offset} are claimed by two different values"
                )
            return known[1]
        if offset < self.high_water:
            raise self.bad(where, f"bytes at offset {offset} overlap an earlier value")
        self.high_water = offset + n
        value = make()
        self.shared[offset] = (descriptor, value)
        return value

    def tensor(
        self,
        dtype: torch.dtype,
        shape: list[int],
        start: int,
        n: int,
        where: str,
        tag: str,
        grad: bool,
        target: object = None,
    ) -> torch.Tensor:
        kind = torch.nn.Parameter if tag == "param" else torch.Tensor
        dst = (
            target
            if isinstance(target, torch.Tensor)
            and type(target) is kind
            and target.dtype == dtype
            and list(target.shape) == shape
            and target.device.type != "meta"
            else None
        )
        if n == 0:
            out = torch.empty(shape, dtype=dtype)
        elif self.view.readonly:  # torch cannot guard read-only memory: copy into owned memory
            out = torch.frombuffer(bytearray(self.view[start : start + n]), dtype=dtype).view(shape)
        else:
            # A storage of its own, starting at the tensor's first byte: some torch code
            # (set_rng_state) reads a storage from its start and ignores the offset, and
            # saving or sending the tensor must not drag the whole shard along.
            out = torch.frombuffer(self.view, dtype=dtype, count=n // dtype.itemsize, offset=start)
            out = out.clone().view(shape) if self.copy and dst is None else out.view(shape)
        if dtype == torch.bool and n and bool(out.reshape(-1).view(torch.uint8).gt(1).any()):
            raise self.bad(where, "a bool tensor holds bytes other than 0 and 1")
        if dst is not None:
            self.copies.append(lambda: _fill(dst, out, grad if tag == "param" else None))
            return dst
        if self.into is not None:
            self.fresh.append(where)
        if tag != "param":
            return out
        try:
            return torch.nn.Parameter(out, requires_grad=grad)
        except RuntimeError as exc:
            raise self.bad(where, f"cannot be a Parameter: {exc}") from exc

    def array(
        self,
        np: Any,
        dtype: Any,
        shape: list[int],
        start: int,
        n: int,
        where: str,
        tag: str,
        target: object = None,
    ) -> Any:
        out = (
            np.frombuffer(self.view, dtype, n // dtype.itemsize, start) if n else np.empty(0, dtype)
        )
        out = out.reshape(shape)
        if dtype.kind == "b" and n and bool((out.view(np.uint8) > 1).any()):
            raise self.bad(where, "a bool array holds bytes other than 0 and 1")
        if tag == "npscalar":
            return out[()]
        if (
            isinstance(target, np.ndarray)
            and type(target) is np.ndarray  # not a subclass
            and target.dtype == dtype
            and list(target.shape) == shape
            and target.flags.writeable
        ):
            self.copies.append(lambda: np.copyto(target, out, casting="equiv"))
            return target
        if self.into is not None:
            self.fresh.append(where)
        return out.copy() if self.copy else out


def _fill(dst: torch.Tensor, src: torch.Tensor, grad: bool | None) -> None:
    dst.copy_(src)
    if grad is not None and dst.requires_grad != grad:
        dst.requires_grad_(grad)


def _numpy(ref: ShardRef) -> Any:
    try:
        return importlib.import_module("numpy")
    except ImportError as exc:
        raise CheckpointError(
            "the shard holds numpy arrays but numpy is not installed", ref=ref
        ) from exc
