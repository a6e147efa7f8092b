"""Bytes to messages and back: every inbound payload goes through :func:`parse`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from phalanx.wire._base import MAX_BATCH_BYTES, Msg
from phalanx.wire._ckpt import CkptCatalog, CkptLanding, CkptLandings, CkptReleased, CkptReport
from phalanx.wire._commands import Command, CommandAck
from phalanx.wire._metrics import MetricsBatch
from phalanx.wire._node import (
    Heartbeat,
    NodeBirth,
    NodeDeath,
    RankEvent,
    RankEvents,
    RankReport,
    SupervisorStatus,
)
from phalanx.wire._topics import (
    PREFIX,
    SUPERVISOR_STATUS_TOPIC,
    match_catalog_topic,
    match_node_topic,
    valid_node_id,
)

MAX_PAYLOAD_BYTES = 256 * 1024
assert MAX_BATCH_BYTES * 2 <= MAX_PAYLOAD_BYTES  # a batch's envelope fits in the rest


class WireError(ValueError):
    """A message that does not follow the contract; carries the topic."""

    def __init__(self, topic: str, reason: str) -> None:
        super().__init__(f"bad message on {topic!r}: {reason}")
        self.topic = topic
        self.reason = reason


Message = (
    NodeBirth
    | NodeDeath
    | Heartbeat
    | Command
    | CommandAck
    | SupervisorStatus
    | RankEvent
    | RankEvents
    | CkptLanding
    | CkptReleased
    | CkptLandings
    | CkptCatalog
    | MetricsBatch
)

# The model of each node topic's payload (one per kind of NODE_TOPIC_KINDS).
_MODELS: dict[str, type[Msg]] = {
    "birth": NodeBirth,
    "death": NodeDeath,
    "heartbeat": Heartbeat,
    "cmd": Command,
    "ack": CommandAck,
    "rank": RankEvent,  # or RankEvents: see _RANK_REPORT
    "ckpt": CkptLanding,  # or CkptReleased: see _CKPT_REPORT
    "metrics": MetricsBatch,
}
_CKPT_REPORT: TypeAdapter[CkptLanding | CkptReleased | CkptLandings] = TypeAdapter(CkptReport)
_RANK_REPORT: TypeAdapter[RankEvent | RankEvents] = TypeAdapter(RankReport)


@dataclass(frozen=True)
class Inbound:
    """A parsed message and the node its topic names (None for fleet-wide topics)."""

    node: str | None
    message: Message | None  # None: a retained message was cleared (empty payload)


def encode(message: BaseModel) -> bytes:
    """The message in JSON, as ``model_dump_json`` writes it, as bytes (without the
    str it makes on the way: a step's catalogs at 2,048 nodes are ~10 MB)."""
    return message.__pydantic_serializer__.to_json(message)


def parse(topic: str, payload: bytes | bytearray | str | None) -> Inbound:
    """Validate one inbound message against the model its topic promises.

    An empty payload is how MQTT clears a retained message; it parses to
    ``Inbound(node, None)``. Everything else must be a valid message whose
    ``node`` field (when it has one) matches the topic.
    """
    if isinstance(payload, str):
        payload = payload.encode()
    payload = bytes(payload or b"")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError(topic, f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    if topic == SUPERVISOR_STATUS_TOPIC:
        if not payload:
            return Inbound(None, None)
        return Inbound(None, _validate(topic, SupervisorStatus, payload))
    if (catalog_of := match_catalog_topic(topic)) is not None:
        if not payload:
            return Inbound(None, None)
        catalog = _validate(topic, CkptCatalog, payload)
        assert isinstance(catalog, CkptCatalog)
        job, node = catalog_of
        if catalog.job != job:
            raise WireError(topic, f"payload names job {catalog.job!r} but the topic names {job!r}")
        if catalog.node != node:
            raise WireError(
                topic, f"payload names node {catalog.node!r} but the topic names {node!r}"
            )
        return Inbound(catalog.node, catalog)
    node_of = match_node_topic(topic)
    if node_of is None:
        raise WireError(topic, f"not a {PREFIX} topic")
    node, kind = node_of
    if not valid_node_id(node):
        raise WireError(topic, f"invalid node id {node!r}")
    if not payload:
        return Inbound(node, None)
    if kind == "ckpt":
        message = _validate(
            topic, _CKPT_REPORT, payload, "CkptLanding, CkptLandings or CkptReleased"
        )
    elif kind == "rank":
        message = _validate(topic, _RANK_REPORT, payload, "RankEvent or RankEvents")
    else:
        message = _validate(topic, _MODELS[kind], payload)
    named = getattr(message, "node", node)
    if named != node:
        raise WireError(topic, f"payload names node {named!r} but the topic names {node!r}")
    return Inbound(node, message)


def _validate(
    topic: str, model: type[Msg] | TypeAdapter[Any], payload: bytes, name: str = ""
) -> Message:
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_json(payload)  # type: ignore[no-any-return]
        return model.model_validate_json(payload)  # type: ignore[return-value]
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()[:5]
        )
        raise WireError(
            topic, f"{name or getattr(model, '__name__', model)} invalid: {errors}"
        ) from exc
