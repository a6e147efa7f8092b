"""The checkpoint store's decoders under fuzz: for any bytes, a shard's preamble, header
and tree (``ckpt.decode``, ``read_ref``, ``shard_nbytes``), a tier's manifest
(``TierManifest.from_json``) and the rank socket's protocol models (``ckpt.protocol``)
give a value or raise their own documented error (``CheckpointError``; pydantic's
``ValidationError`` for the models), and nothing else. Hypothesis, derandomized, with a
bounded number of examples per property."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

import ckpt
from ckpt import CheckpointError, protocol
from ckpt.format import read_ref, shard_nbytes
from ckpt.tiers import TierManifest
from tests.unit.ckpt.test_format import craft, tensor_node

SETTINGS = settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**64)
    | st.floats()
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
deep = st.integers(1, 50_000).map(lambda n: "[" * n + "]" * n)


def only(errors: type[Exception] | tuple[type[Exception], ...], call: Any, *args: Any) -> None:
    with contextlib.suppress(errors):
        call(*args)


# --- shards -------------------------------------------------------------------------------

TAGS = ["tuple", "size", "dict", "odict", "float", "tensor", "param", "ndarray", "npscalar",
        "bytes", "bytearray", "nope"]  # fmt: skip
node_fields = st.fixed_dictionaries(
    {"t": st.sampled_from(TAGS)},
    optional={
        "v": json_values,
        "k": json_values,
        "m": json_values,
        "bits": st.text(max_size=20) | st.sampled_from(["7ff8000000000000", "0" * 16]),
        "dtype": st.sampled_from(["float32", "int64", "bool", "bfloat16", "<f4", "object", "x"]),
        "shape": st.lists(st.integers(-2, 2**40), max_size=4) | json_values,
        "o": st.integers(-64, 2**64) | json_values,
        "n": st.integers(-64, 2**64) | json_values,
        "grad": json_values,
    },
)
trees = st.recursive(
    scalars | node_fields,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.fixed_dictionaries({"t": st.sampled_from(["tuple", "size"]), "v": st.lists(inner)})
        | st.fixed_dictionaries(
            {"t": st.sampled_from(["dict", "odict"]), "k": st.lists(inner), "v": st.lists(inner)}
        )
    ),
    max_leaves=10,
)
metas = st.dictionaries(st.sampled_from(["job", "step", "rank", "x"]), json_values, max_size=3)


@SETTINGS
@given(st.binary(max_size=600))
def test_any_bytes_decode_or_raise_a_checkpoint_error(data: bytes) -> None:
    only(CheckpointError, ckpt.decode, bytearray(data))
    only(CheckpointError, read_ref, data)
    only(CheckpointError, shard_nbytes, data)


@SETTINGS
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_any_bytes_after_a_valid_magic_decode_or_raise_a_checkpoint_error(
    head: bytes, tail: bytes
) -> None:
    data = b"PHXSHARD" + head + tail
    only(CheckpointError, ckpt.decode, bytearray(data))
    only(CheckpointError, read_ref, data)


@SETTINGS
@given(json_values)
def test_any_sealed_header_decodes_or_raises_a_checkpoint_error(header: Any) -> None:
    shard = craft(header)
    only(CheckpointError, ckpt.decode, shard)
    only(CheckpointError, read_ref, shard)


@SETTINGS
@given(st.binary(max_size=300) | deep.map(str.encode))
def test_any_sealed_header_bytes_decode_or_raise_a_checkpoint_error(text: bytes) -> None:
    only(CheckpointError, ckpt.decode, craft(text))


@settings(SETTINGS, max_examples=150)
@given(trees, metas, st.binary(max_size=256))
def test_any_sealed_tree_decodes_or_raises_a_checkpoint_error(
    tree: Any, meta: dict[str, Any], data: bytes
) -> None:
    data_nbytes = len(data) + (-len(data) % 64)
    shard = craft({"data": data_nbytes, "meta": meta, "tree": tree}, data)
    only(CheckpointError, ckpt.decode, shard)
    only(CheckpointError, lambda: ckpt.decode(shard, copy=True))  # other paths


@SETTINGS
@given(st.integers(1, 5000))
def test_a_tree_nested_past_any_depth_raises_a_checkpoint_error(depth: int) -> None:
    tree = "[" * depth + json.dumps(tensor_node()) + "]" * depth
    shard = craft(f'{{"data": 64, "meta": {{}}, "tree": {tree}}}'.encode(), bytes(64))
    only(CheckpointError, ckpt.decode, shard)


# --- manifests ----------------------------------------------------------------------------

MANIFEST = TierManifest("job-1", 7, {0: ("xxh3_128:" + "0" * 32, 128)}, "zstd", 1.0, 2)


@st.composite
def mutated_manifests(draw: st.DrawFn) -> bytes:
    data: Any = json.loads(MANIFEST.to_json())
    where = draw(st.sampled_from([*data, "shards.0"]))
    holder = data["shards"][0] if where == "shards.0" else data
    key = draw(st.sampled_from(list(holder))) if where == "shards.0" else where
    if draw(st.booleans()):
        holder[key] = draw(json_values | st.sampled_from([1e999, -1e999, float("nan")]))
    else:
        del holder[key]
    return json.dumps(data).encode()


def test_the_manifest_the_mutations_start_from_reads_back() -> None:
    assert TierManifest.from_json(MANIFEST.to_json(), where="m") == MANIFEST


@SETTINGS
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_any_manifest_bytes_read_or_raise_a_checkpoint_error(data: bytes) -> None:
    only(CheckpointError, lambda: TierManifest.from_json(data, where="m"))


@SETTINGS
@given(mutated_manifests())
def test_any_mutated_manifest_reads_or_raises_a_checkpoint_error(data: bytes) -> None:
    only(CheckpointError, lambda: TierManifest.from_json(data, where="m"))


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 50_000 + b"]" * 50_000,
        MANIFEST.to_json().replace(b'"rank": 0', b'"rank": 1e999'),
        MANIFEST.to_json().replace(b'"committed_at": 1.0', b'"committed_at": ' + b"9" * 400),
    ],
    ids=["deep", "infinite rank", "committed_at past a float"],
)
def test_a_hostile_manifest_is_a_checkpoint_error_naming_it(data: bytes) -> None:
    with pytest.raises(CheckpointError, match="manifest m is not valid"):
        TierManifest.from_json(data, where="m")


# --- the rank socket's protocol -----------------------------------------------------------

MODELS: list[type[BaseModel]] = [
    getattr(protocol, name)
    for name in protocol.__all__
    if isinstance(getattr(protocol, name), type) and issubclass(getattr(protocol, name), BaseModel)
]
FIELD_NAMES = sorted({f for m in MODELS for f in m.model_fields})
bodies = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), json_values)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
@settings(SETTINGS, max_examples=100)
@given(
    body=st.binary(max_size=200)
    | bodies.map(lambda v: json.dumps(v).encode())
    | deep.map(str.encode)
)
def test_any_body_validates_or_raises_a_validation_error(
    model: type[BaseModel], body: bytes
) -> None:
    only(ValidationError, model.model_validate_json, body)


@pytest.mark.parametrize(
    "model",
    [protocol.RestoreQuery, protocol.ShardQuery, protocol.RankQuery],
    ids=lambda m: m.__name__,
)
@settings(SETTINGS, max_examples=100)
@given(query=st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), st.text()))
def test_any_query_validates_or_raises_a_validation_error(
    model: type[BaseModel], query: dict[str, str]
) -> None:
    only(ValidationError, model.model_validate, query)


@settings(SETTINGS, max_examples=50)
@given(bodies)
def test_problems_describes_any_validation_error(body: dict[str, Any]) -> None:
    try:
        protocol.AcquireRequest.model_validate(body)
    except ValidationError as exc:
        assert protocol.problems(exc)
