"""Every MQTT topic of the contract: built here, matched here, nowhere else.

A node's topics are ``PREFIX/node/{node}/{kind}``, one per kind of
:data:`NODE_TOPIC_KINDS`; a job's checkpoint catalogs are
``PREFIX/job/{job}/ckpt/{node}``, one per node.
"""

from __future__ import annotations

import re
from typing import Final

from phalanx.wire._base import JOB_ID_PATTERN, NODE_ID_PATTERN

PREFIX: Final = "phalanx/v1"

# The kinds of a node's topics: what its agent publishes, and ``cmd``, the supervisor's.
NODE_TOPIC_KINDS: Final = (
    "birth",
    "death",
    "heartbeat",
    "cmd",
    "ack",
    "rank",
    "ckpt",
    "metrics",
)

_NODE_ID_RE = re.compile(NODE_ID_PATTERN)
_JOB_ID_RE = re.compile(JOB_ID_PATTERN)
_NODE_TOPIC_RE = re.compile(rf"^{re.escape(PREFIX)}/node/([^/]+)/({'|'.join(NODE_TOPIC_KINDS)})$")
_CATALOG_TOPIC_RE = re.compile(rf"^{re.escape(PREFIX)}/job/([^/]+)/ckpt/([^/]+)$")


def valid_node_id(node: str) -> bool:
    return _NODE_ID_RE.match(node) is not None


def _node(node: str) -> str:
    if not valid_node_id(node):
        raise ValueError(f"invalid node id {node!r}: must match {NODE_ID_PATTERN}")
    return node


def _job(job: str) -> str:
    if not _JOB_ID_RE.match(job):
        raise ValueError(f"invalid job id {job!r}: must match {JOB_ID_PATTERN}")
    return job


def _node_topic(node: str, kind: str) -> str:
    return f"{PREFIX}/node/{node}/{kind}"


def birth_topic(node: str) -> str:
    return _node_topic(_node(node), "birth")


def death_topic(node: str) -> str:
    return _node_topic(_node(node), "death")


def heartbeat_topic(node: str) -> str:
    return _node_topic(_node(node), "heartbeat")


def command_topic(node: str) -> str:
    return _node_topic(_node(node), "cmd")


def ack_topic(node: str) -> str:
    return _node_topic(_node(node), "ack")


def rank_topic(node: str) -> str:
    return _node_topic(_node(node), "rank")


def ckpt_topic(node: str) -> str:
    return _node_topic(_node(node), "ckpt")


def metrics_topic(node: str) -> str:
    return _node_topic(_node(node), "metrics")


def catalog_prefix(job: str) -> str:
    """What every catalog topic of ``job`` starts with (``catalog_topic`` adds the node)."""
    return f"{PREFIX}/job/{_job(job)}/ckpt/"


def catalog_topic(job: str, node: str) -> str:
    return catalog_prefix(job) + _node(node)


def catalog_filter(job: str) -> str:
    """The subscription that receives every node's catalog of ``job``."""
    return catalog_prefix(job) + "+"


SUPERVISOR_STATUS_TOPIC: Final = f"{PREFIX}/supervisor/status"

# Subscriptions, one per consumer: the supervisor hears every node topic but ``cmd``.
SUPERVISOR_SUBSCRIPTIONS: Final = tuple(
    _node_topic("+", kind) for kind in NODE_TOPIC_KINDS if kind != "cmd"
)


def agent_subscriptions(node: str) -> tuple[str, ...]:
    """A node's commands, its view of the jobs' catalogs, and whether the supervisor is
    online (the node sends what it owes the supervisor only then)."""
    return (command_topic(node), f"{PREFIX}/job/+/ckpt/{_node(node)}", SUPERVISOR_STATUS_TOPIC)


def match_node_topic(topic: str) -> tuple[str, str] | None:
    """``(node, kind)`` of a node topic (the node id not checked yet); None: not one."""
    found = _NODE_TOPIC_RE.match(topic)
    return None if found is None else (found.group(1), found.group(2))


def match_catalog_topic(topic: str) -> tuple[str, str] | None:
    """``(job, node)`` of a catalog topic; None: not one."""
    found = _CATALOG_TOPIC_RE.match(topic)
    return None if found is None else (found.group(1), found.group(2))
