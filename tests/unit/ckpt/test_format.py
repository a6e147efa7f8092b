"""The shard format: bit-exact round trips, zero-copy reads, checksums, and
refusal of untrusted bytes (crafted headers, pickle payloads)."""

from __future__ import annotations

import json
import math
import multiprocessing
import pickle
import random
import struct
from collections import OrderedDict, namedtuple
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import ckpt.format as ckpt_format
from ckpt import (
    CheckpointError,
    FormatError,
    ShardCorrupt,
    ShardMismatch,
    ShardRef,
    UnsafeShard,
    UnsupportedValue,
    UnsupportedVersion,
    checksum,
    decode,
    encode,
    plan,
    read_ref,
    seal,
    shard_nbytes,
    verify,
    write_into,
)
from ckpt.format import Hasher

try:
    import numpy as np
except ImportError:  # numpy is optional for the format; its tests skip without it
    np = None  # type: ignore[assignment]

needs_numpy = pytest.mark.skipif(np is None, reason="numpy is not installed")

ALL_TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_identical(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} came back as {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert torch.equal(raw_bytes(a), raw_bytes(b)), where
        assert a.requires_grad == b.requires_grad, where
    elif np is not None and isinstance(a, np.ndarray | np.generic):
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), where
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], where
        for k in a:
            assert_bit_identical(a[k], b[k], f"{where}[{k!r}]")
        assert_bit_identical(getattr(a, "_metadata", None), getattr(b, "_metadata", None), where)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), where
    else:
        assert a == b, where


def round_trip(state: Any) -> Any:
    return decode(encode(state))


def trained_model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(16, 4)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def craft(header: Any, data: bytes = b"", *, header_nbytes: int | None = None) -> bytearray:
    """A sealed shard built by hand from the documented layout, header and all."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    data_start = -(-(32 + len(text)) // 64) * 64
    data = data + bytes(-len(data) % 64)
    nbytes = data_start + len(data) + 32
    preamble = struct.pack(
        "<8sIIQQ", b"PHXSHARD", 1, len(text) if header_nbytes is None else header_nbytes, nbytes, 0
    )
    body = preamble + text + bytes(data_start - 32 - len(text)) + data
    return bytearray(
        body + struct.pack("<8sQ16s", b"PHXSEAL\0", nbytes, xxhash.xxh3_128(body).digest())
    )


def tensor_node(
    dtype: str = "float32", shape: list[Any] | None = None, o: Any = 0, n: Any = 8
) -> dict[str, Any]:
    return {"t": "tensor", "dtype": dtype, "shape": [2] if shape is None else shape, "o": o, "n": n}


def shard_with_tree(tree: Any, data: bytes = bytes(64)) -> bytearray:
    data_nbytes = len(data) + (-len(data) % 64)
    return craft({"data": data_nbytes, "meta": {}, "tree": tree}, data)


# --------------------------------------------------------------------------- round trips


def test_model_and_adam_state_dicts_round_trip_bit_exact() -> None:
    model, optimizer = trained_model_and_adam()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}
    assert_bit_identical(state, round_trip(state))


def test_restored_model_and_adam_take_the_same_next_step() -> None:
    model, optimizer = trained_model_and_adam()
    restored = round_trip({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    twin, twin_optimizer = trained_model_and_adam()
    twin.load_state_dict(restored["model"])
    twin_optimizer.load_state_dict(restored["optimizer"])
    batch = torch.randn(16, 4)
    for m, opt in ((model, optimizer), (twin, twin_optimizer)):
        m(batch).square().mean().backward()
        opt.step()
    assert_bit_identical(model.state_dict(), twin.state_dict())


def test_torch_rng_state_round_trips_and_replays_the_same_draws() -> None:
    torch.manual_seed(1234)
    torch.rand(7)
    state = torch.get_rng_state()
    expected = torch.rand(5)
    torch.set_rng_state(round_trip({"torch": state})["torch"])
    assert torch.equal(torch.rand(5), expected)


def test_python_random_state_round_trips_as_nested_tuples() -> None:
    rng = random.Random(99)
    state = rng.getstate()
    expected = [rng.random() for _ in range(5)]
    restored = round_trip(state)
    assert_bit_identical(state, restored)
    rng.setstate(restored)
    assert [rng.random() for _ in range(5)] == expected


@needs_numpy
def test_numpy_legacy_rng_state_round_trips_and_replays_the_same_draws() -> None:
    legacy = np.random.RandomState(7)
    legacy.standard_normal(3)  # leaves a cached gaussian in the state
    state = legacy.get_state()
    expected = legacy.standard_normal(4)
    restored = round_trip(state)
    assert_bit_identical(state, restored)
    legacy.set_state(restored)
    assert legacy.standard_normal(4).tobytes() == expected.tobytes()


@needs_numpy
def test_numpy_generator_state_with_128_bit_integers_round_trips() -> None:
    generator = np.random.default_rng(11)
    state = generator.bit_generator.state
    expected = generator.random(4)
    generator.bit_generator.state = round_trip(state)
    assert generator.random(4).tobytes() == expected.tobytes()


@pytest.mark.parametrize("dtype", ALL_TORCH_DTYPES, ids=str)
def test_every_allowed_torch_dtype_round_trips_bit_exact(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(5)
    raw = torch.randint(
        0,
        2 if dtype == torch.bool else 256,
        (3 * 5 * dtype.itemsize,),
        dtype=torch.uint8,
        generator=generator,
    )
    tensor = raw.view(dtype).view(3, 5)
    assert_bit_identical(tensor, round_trip(tensor))


def test_non_contiguous_conjugate_zero_size_and_scalar_tensors_round_trip() -> None:
    state = {
        "transposed": torch.arange(12.0).view(3, 4).t(),
        "strided": torch.arange(20).view(4, 5)[::2, 1::2],
        "conjugate": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    restored = round_trip(state)
    for name, tensor in state.items():
        assert_bit_identical(tensor.resolve_conj().contiguous(), restored[name], name)


def test_plain_values_round_trip_type_faithfully() -> None:
    state = {
        "ints": [0, -1, 2**64 + 1, -(2**100)],
        "floats": [0.1, -0.0, float("nan"), float("inf"), -float("inf"), 5e-324],
        "strings": ["", "ünï\u00e7ode ✓", "a\x00b", "\ud800"],
        "flags": (True, False, None),
        "blobs": (b"\x00\xff" * 40, bytearray(b"mutable"), b""),
        "tuple_vs_list": ((1, 2), [1, 2], ()),
        "size": torch.Size([3, 0, 2]),
        "ordered": OrderedDict([("b", 1), ("a", 2)]),
        0: "int key",
        -7: "negative int key",
        (1, "x"): "tuple key",
        2.5: "float key",
        True: "bool key",
        None: "none key",
    }
    assert_bit_identical(state, round_trip(state))


def test_nan_payload_bits_survive_a_round_trip() -> None:
    odd_nan = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]
    assert struct.pack("<d", round_trip([odd_nan])[0]) == struct.pack("<d", odd_nan)


def test_state_dict_metadata_survives_so_versioned_modules_load_alike() -> None:
    model, _ = trained_model_and_adam()
    restored = round_trip(model.state_dict())
    assert type(restored) is OrderedDict
    assert restored._metadata == model.state_dict()._metadata  # type: ignore[attr-defined]


@needs_numpy
def test_numpy_arrays_and_scalars_round_trip_bit_exact() -> None:
    state = {
        "f32": np.linspace(0, 1, 7, dtype=np.float32),
        "strided": np.arange(24, dtype=np.int16).reshape(4, 6)[:, ::2],
        "big_endian": np.arange(5, dtype=">i4"),
        "empty": np.zeros((0, 2), dtype=np.complex128),
        "bools": np.array([True, False, True]),
        "scalars": (np.float64(1.25), np.int32(-3), np.bool_(True), np.uint64(2**63)),
    }
    restored = round_trip(state)
    assert restored["big_endian"].tolist() == [0, 1, 2, 3, 4]
    state["strided"] = np.ascontiguousarray(state["strided"])
    state["big_endian"] = state["big_endian"].astype("<i4")
    assert_bit_identical(state, restored)


def test_one_tensor_reached_twice_comes_back_as_one_object() -> None:
    shared = torch.arange(6.0)
    restored = round_trip({"a": shared, "b": [shared]})
    assert restored["a"] is restored["b"][0]


def test_parameter_comes_back_as_parameter_keeping_requires_grad() -> None:
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    restored = round_trip([torch.nn.Parameter(torch.ones(2)), frozen])
    assert_bit_identical([torch.nn.Parameter(torch.ones(2)), frozen], restored)


Point = namedtuple("Point", "x y")


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ({"model": {"w": object()}}, "state['model']['w']"),
        ({"s": {1, 2}}, "state['s']"),
        ([Point(1, 2)], "state[0]"),
        ({"sparse": torch.eye(3).to_sparse()}, "state['sparse']"),
        ({frozenset(): 1}, "state[frozenset()]"),
        ({"c": 1 + 2j}, "state['c']"),
    ],
    ids=["object", "set", "namedtuple", "sparse", "frozenset-key", "complex"],
)
def test_unsupported_value_is_refused_naming_where_it_sits(value: Any, where: str) -> None:
    with pytest.raises(UnsupportedValue, match=__import__("re").escape(where)):
        plan(value, ref=ShardRef(job="j", step=1, rank=0))


def test_self_containing_list_is_refused_not_recursed_forever() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(UnsupportedValue, match="deeper"):
        plan(loop)


# --------------------------------------------------------------------------- zero copy


def test_decode_returns_views_that_share_the_buffers_memory() -> None:
    buffer = encode({"w": torch.zeros(4, dtype=torch.float32)})
    restored = decode(buffer)["w"]
    offset = restored.data_ptr() - torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    buffer[offset : offset + 4] = struct.pack("<f", 7.0)
    assert restored.tolist() == [7.0, 0.0, 0.0, 0.0]


@needs_numpy
def test_decode_returns_numpy_views_that_share_the_buffers_memory() -> None:
    buffer = encode({"a": np.zeros(2, dtype=np.float64)})
    restored = decode(buffer)["a"]
    assert np.shares_memory(restored, np.frombuffer(buffer, dtype=np.uint8))


def test_zero_copy_tensors_each_own_a_storage_of_exactly_their_bytes() -> None:
    restored = decode(encode({"a": torch.ones(3), "b": torch.ones(2, 5, dtype=torch.int64)}))
    for tensor in restored.values():
        assert tensor.storage_offset() == 0
        assert tensor.untyped_storage().nbytes() == tensor.nbytes


def test_decode_with_copy_owns_its_memory() -> None:
    buffer = encode({"w": torch.zeros(4)})
    restored = decode(buffer, copy=True)["w"]
    buffer[:] = bytes(len(buffer))
    assert restored.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert restored.untyped_storage().nbytes() == 16


def test_tensor_data_is_aligned_to_64_bytes() -> None:
    buffer = encode({"a": torch.ones(3, dtype=torch.int8), "b": torch.ones(5), "c": torch.ones(1)})
    base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    assert all((t.data_ptr() - base) % 64 == 0 for t in decode(buffer).values())


def test_read_only_bytes_decode_to_writable_copies_without_a_warning() -> None:
    restored = decode(bytes(encode({"w": torch.arange(3)})))["w"]
    restored += 1
    assert restored.tolist() == [1, 2, 3]


def test_write_into_a_dirty_reused_buffer_gives_the_same_bytes_as_encode() -> None:
    model, optimizer = trained_model_and_adam()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    shard_plan = plan(state)
    buffer = bytearray(b"\xa5" * shard_plan.nbytes)
    write_into(shard_plan, buffer)
    seal(buffer)
    assert buffer == encode(state)


def test_shard_laid_into_shared_memory_restores_after_the_segment_is_gone() -> None:
    state = {"w": torch.randn(64, 64), "step": 3}
    shard_plan = plan(state)
    segment = shared_memory.SharedMemory(create=True, size=shard_plan.nbytes)
    try:
        view = segment.buf[: shard_plan.nbytes]
        write_into(shard_plan, view)
        seal(view)
        restored = decode(view, copy=True)
        view.release()
    finally:
        segment.close()
        segment.unlink()
    assert_bit_identical(state, restored)


def test_write_into_refuses_a_buffer_of_the_wrong_size() -> None:
    shard_plan = plan({"w": torch.ones(2)})
    with pytest.raises(ValueError, match=str(shard_plan.nbytes)):
        write_into(shard_plan, bytearray(shard_plan.nbytes + 64))


# --------------------------------------------------------------------------- checksum


def small_shard() -> bytearray:
    return encode(
        {"w": torch.arange(10, dtype=torch.int16), "b": b"xyz", "lr": 0.1},
        ref=ShardRef(job="j", step=2, rank=0),
    )


def test_verify_returns_the_checksum_that_seal_recorded() -> None:
    shard = small_shard()
    assert verify(shard) == checksum(shard) == seal(shard)
    assert checksum(shard).startswith("xxh3_128:")


def test_verify_detects_a_flipped_byte_anywhere_in_the_shard() -> None:
    shard = small_shard()
    missed = []
    for i in range(len(shard)):
        damaged = bytearray(shard)
        damaged[i] ^= 0x10
        try:
            verify(damaged)
        except ShardCorrupt:
            continue
        missed.append(i)
    assert missed == []


def test_verify_rejects_a_shard_whose_checksum_is_not_the_expected_one() -> None:
    other = checksum(encode({"w": torch.ones(1)}))
    with pytest.raises(ShardCorrupt, match="was expected"):
        verify(small_shard(), other)


# --------------------------------------------------------------------------- the seal in pieces


@pytest.fixture
def small_seal_chunk(monkeypatch: pytest.MonkeyPatch) -> int:
    """64 MiB pieces made 4 KiB, so a shard of a few KiB spans many."""
    monkeypatch.setattr(ckpt_format, "SEAL_CHUNK", 4096)
    return 4096


def many_piece_shard() -> bytearray:
    return encode({"w": torch.arange(10_000, dtype=torch.float32), "step": 7})


def test_a_shard_seals_in_pieces_and_verifies_them_in_parallel(small_seal_chunk: int) -> None:
    shard = many_piece_shard()
    assert len(shard) > 9 * small_seal_chunk
    body = memoryview(shard)[:-32]
    pieces = [
        xxhash.xxh3_128(body[o : o + small_seal_chunk]).digest()
        for o in range(0, len(body), small_seal_chunk)
    ]
    expected = "xxh3_128:" + xxhash.xxh3_128(b"".join(pieces)).hexdigest()

    assert seal(shard) == expected
    assert verify(shard) == expected  # on the verifying pool: several pieces at once
    assert ckpt_format._pool is not None


def test_a_flipped_byte_in_a_later_piece_is_detected(small_seal_chunk: int) -> None:
    shard = many_piece_shard()
    for i in (small_seal_chunk * 3 + 5, len(shard) - 33):
        damaged = bytearray(shard)
        damaged[i] ^= 0x01
        with pytest.raises(ShardCorrupt, match="content hashes to"):
            verify(damaged)


@pytest.mark.parametrize("piece", [1, 7, 4096, 5000, 1 << 20])
def test_the_streaming_hasher_agrees_with_the_seal_however_the_bytes_arrive(
    small_seal_chunk: int,
    piece: int,
) -> None:
    shard = many_piece_shard()
    hasher = Hasher()
    body = memoryview(shard)[:-32]
    for o in range(0, len(body), piece):
        hasher.update(body[o : o + piece])
    assert "xxh3_128:" + hasher.hexdigest() == verify(shard)


def test_a_shard_of_exactly_whole_pieces_hashes_alike_streamed_or_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shard = many_piece_shard()
    body_nbytes = len(shard) - 32
    monkeypatch.setattr(
        ckpt_format, "SEAL_CHUNK", body_nbytes // 4 if body_nbytes % 4 == 0 else body_nbytes
    )
    hasher = Hasher()
    hasher.update(memoryview(shard)[:-32])
    assert "xxh3_128:" + hasher.hexdigest() == seal(shard) == verify(shard)


def test_version_1_shards_sealed_whole_are_still_verified_and_read(small_seal_chunk: int) -> None:
    data = struct.pack("<2f", 1.5, -2.0) + bytes(3 * small_seal_chunk)
    shard = shard_with_tree({"t": "dict", "k": [0], "v": [tensor_node()]}, data)
    assert shard[8:12] == (1).to_bytes(4, "little")
    whole = "xxh3_128:" + xxhash.xxh3_128(memoryview(shard)[:-32]).hexdigest()
    hasher = Hasher()
    for o in range(0, len(shard) - 32, 1000):
        hasher.update(memoryview(shard)[o : min(o + 1000, len(shard) - 32)])

    assert verify(shard) == whole == "xxh3_128:" + hasher.hexdigest()
    assert decode(shard)[0].tolist() == [1.5, -2.0]
    damaged = bytearray(shard)
    damaged[-40] ^= 0x01
    with pytest.raises(ShardCorrupt):
        verify(damaged)


def test_an_unknown_format_version_is_refused_naming_the_ones_read() -> None:
    shard = small_shard()
    shard[8:12] = (3).to_bytes(4, "little")
    with pytest.raises(UnsupportedVersion, match=r"version 3 is not supported \(this reads 1, 2\)"):
        decode(shard, verify=False)


def test_a_forked_child_verifies_on_its_own_pool(small_seal_chunk: int) -> None:
    shard = many_piece_shard()
    expected = verify(shard)  # the parent's pool now has threads the child will not
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply(verify, (bytes(shard),)) == expected


@pytest.mark.parametrize("keep", [0, 7, 31, 100, -64, -33, -32, -1])
def test_truncated_shard_fails_verification(keep: int) -> None:
    shard = small_shard()
    with pytest.raises(ShardCorrupt):
        verify(shard[:keep])


@pytest.mark.parametrize("keep", [7, 31, 100, -32, -1])
def test_truncated_shard_is_rejected_by_decode(keep: int) -> None:
    with pytest.raises(ShardCorrupt):
        decode(small_shard()[:keep], verify=False)


def test_shard_laid_but_never_sealed_fails_verification() -> None:
    shard_plan = plan({"w": torch.ones(3)})
    buffer = bytearray(shard_plan.nbytes)
    write_into(shard_plan, buffer)
    with pytest.raises(ShardCorrupt, match="never sealed"):
        decode(buffer)


def test_decode_verifies_the_seal_by_default() -> None:
    shard = small_shard()
    shard[-40] ^= 1
    with pytest.raises(ShardCorrupt, match="hashes to"):
        decode(shard)


def test_shard_for_another_step_is_refused_as_a_mismatch() -> None:
    with pytest.raises(ShardMismatch, match="step 2, not 3"):
        decode(small_shard(), ref=ShardRef(step=3, path="/nvme/j/3/0.shard"))


def test_errors_carry_the_shard_ids_as_attributes_and_in_the_message() -> None:
    shard = small_shard()
    shard[100] ^= 1
    with pytest.raises(ShardCorrupt) as caught:
        decode(shard, ref=ShardRef(path="/nvme/j/2/0.shard"))
    error = caught.value
    assert (error.job, error.step, error.rank, error.path) == (
        None,
        None,
        None,
        "/nvme/j/2/0.shard",
    )
    assert "path=/nvme/j/2/0.shard" in str(error)
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_header_ids_name_the_shard_in_errors_raised_after_the_header_is_read() -> None:
    shard = craft(
        {"data": 64, "meta": {"job": "j", "step": 5, "rank": 3}, "tree": {"t": "nope"}}, bytes(64)
    )
    with pytest.raises(FormatError) as caught:
        decode(shard)
    assert (caught.value.job, caught.value.step, caught.value.rank) == ("j", 5, 3)


def test_read_ref_and_shard_nbytes_need_only_the_head_of_the_file() -> None:
    shard = small_shard()
    head = bytes(shard[:256])
    assert shard_nbytes(head[:32]) == len(shard)
    assert read_ref(head, path="p") == ShardRef(job="j", step=2, rank=0, path="p")


# --------------------------------------------------------------------------- crafted headers


@pytest.mark.parametrize(
    "dtype", ["object", "float32; __import__('os')", "torch.float32", "complex32", 5]
)
def test_header_with_a_dtype_outside_the_allow_list_is_rejected(dtype: Any) -> None:
    with pytest.raises(FormatError, match="allow-list"):
        decode(shard_with_tree(tensor_node(dtype=dtype)))


@pytest.mark.parametrize(("o", "n"), [(64, 8), (0, 72), (2**63, 8), (-64, 8), (0, -8)])
def test_header_with_a_region_outside_the_data_is_rejected(o: int, n: int) -> None:
    with pytest.raises(FormatError):
        decode(shard_with_tree(tensor_node(shape=[n // 4] if n > 0 else [0], o=o, n=n)))


@pytest.mark.parametrize(
    "shape",
    [[2**62, 2**62], [3], [-2], [2.0], ["2"], [1] * 65, [2**64], None],
    ids=["overflowing", "too-big", "negative", "float", "string", "too-many-dims", "2**64", "null"],
)
def test_header_with_an_absurd_shape_is_rejected(shape: Any) -> None:
    node = tensor_node(shape=shape)
    if shape is None:
        node["shape"] = None
    with pytest.raises(FormatError, match="shape"):
        decode(shard_with_tree(node))


def test_preamble_declaring_a_huge_header_is_rejected() -> None:
    shard = shard_with_tree(tensor_node())
    shard[12:16] = struct.pack("<I", 2**32 - 1)
    with pytest.raises(FormatError, match="header length"):
        decode(shard)


def test_preamble_declaring_a_header_past_the_end_is_rejected() -> None:
    shard = shard_with_tree(tensor_node())
    shard[12:16] = struct.pack("<I", len(shard))
    with pytest.raises(FormatError):
        decode(shard)


@pytest.mark.parametrize(
    "tree",
    [
        json.loads('{"t": "tuple", "v": [' * 100 + "]}" * 100),
        json.loads("[" * 200 + "]" * 200),
    ],
    ids=["tagged", "arrays"],
)
def test_deeply_nested_tree_is_rejected(tree: Any) -> None:
    with pytest.raises(FormatError, match="deeper"):
        decode(shard_with_tree(tree))


def test_header_nested_past_the_json_parsers_limit_is_rejected() -> None:
    text = b'{"data":64,"meta":{},"tree":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(FormatError, match="not valid JSON"):
        decode(craft(text, bytes(64)))


@pytest.mark.parametrize(
    "text",
    [
        b'{"data":64,"meta":{},"tree":NaN}',
        b'{"data":64,"data":64,"meta":{},"tree":1}',
        b"\xff\xfe{}",
        b"[]",
    ],
    ids=["nan-literal", "duplicate-key", "not-utf8", "not-an-object"],
)
def test_header_that_is_not_the_expected_json_is_rejected(text: bytes) -> None:
    with pytest.raises(FormatError, match="header"):
        decode(craft(text, bytes(64)))


@pytest.mark.parametrize(
    "tree",
    [
        {"t": "pickle", "v": "gASV"},
        {"t": ["tensor"]},
        {"v": 1},
        {"t": "dict", "k": [[1]], "v": [1]},
        {"t": "dict", "k": ["a", "a"], "v": [1, 2]},
        {"t": "dict", "k": ["a"], "v": [1, 2]},
        {"t": "float", "bits": "zz"},
        {"t": "size", "v": [-1]},
        {**tensor_node(), "extra": 1},
        {**tensor_node(dtype="int64"), "t": "param", "grad": True},
    ],
    ids=[
        "unknown-tag",
        "non-string-tag",
        "untagged-object",
        "list-key",
        "duplicate-key",
        "ragged-dict",
        "bad-float-bits",
        "negative-size",
        "extra-field",
        "int-param-with-grad",
    ],
)
def test_malformed_tree_node_is_rejected(tree: Any) -> None:
    with pytest.raises(FormatError, match="header field"):
        decode(shard_with_tree(tree))


def test_regions_that_overlap_or_are_misaligned_are_rejected() -> None:
    overlapping = [tensor_node(o=0, n=8), tensor_node(dtype="int32", o=0, n=8)]
    with pytest.raises(FormatError, match="claimed by two"):
        decode(shard_with_tree(overlapping))
    with pytest.raises(FormatError, match="multiple of 64"):
        decode(shard_with_tree(tensor_node(o=4, n=8), bytes(128)))


def test_bool_tensor_with_bytes_other_than_zero_and_one_is_rejected() -> None:
    node = tensor_node(dtype="bool", shape=[2], n=2)
    with pytest.raises(FormatError, match="bool"):
        decode(shard_with_tree(node, b"\x01\x07" + bytes(62)))


def test_crafted_shard_that_passes_every_check_decodes() -> None:
    data = struct.pack("<2f", 1.5, -2.0) + bytes(56)
    restored = decode(shard_with_tree({"t": "dict", "k": [0], "v": [tensor_node()]}, data))
    assert restored == {0: restored[0]} and restored[0].tolist() == [1.5, -2.0]


# --------------------------------------------------------------------------- pickle payloads


class CreatesMarker:
    """Unpickling this runs ``open(marker, "w")``: a stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def test_the_crafted_pickle_payload_does_run_code_when_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    pickle.loads(pickle.dumps(CreatesMarker(marker))).close()
    assert marker.exists()


def torch_save(payload: Any, path: Path) -> None:
    torch.save({"model": payload}, path)


def torch_save_legacy(payload: Any, path: Path) -> None:
    torch.save({"model": payload}, path, _use_new_zipfile_serialization=False)


def pickle_dump(protocol: int) -> Callable[[Any, Path], None]:
    return lambda payload, path: path.write_bytes(pickle.dumps(payload, protocol=protocol))


@pytest.mark.parametrize(
    ("writer", "error"),
    [
        (torch_save, UnsafeShard),
        (torch_save_legacy, UnsafeShard),
        *[(pickle_dump(p), UnsafeShard) for p in (2, 3, 4, 5)],
        *[(pickle_dump(p), FormatError) for p in (0, 1)],
    ],
    ids=["torch.save", "torch.save-legacy", *(f"pickle-{p}" for p in (2, 3, 4, 5, 0, 1))],
)
def test_pickle_payload_is_refused_without_running_its_code(
    tmp_path: Path, writer: Callable[[Any, Path], None], error: type[CheckpointError]
) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.shard"
    writer(CreatesMarker(marker), path)
    for verify_first in (True, False):
        with pytest.raises(error):
            decode(path.read_bytes(), verify=verify_first, ref=ShardRef(path=str(path)))
    assert not marker.exists()


def test_pickle_payload_behind_a_valid_preamble_is_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(CreatesMarker(marker))
    tree = {"t": "bytes", "o": 0, "n": len(payload)}
    restored = decode(shard_with_tree(tree, payload))
    assert restored == payload and not marker.exists()


def test_float_header_values_are_plain_numbers_even_when_huge() -> None:
    restored = decode(craft(b'{"data":0,"meta":{},"tree":[1e400,-1e400]}'))
    assert restored == [math.inf, -math.inf]
