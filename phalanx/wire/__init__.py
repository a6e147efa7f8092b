"""The wire contract: every MQTT topic and every message, in one place.

Both daemons import this package; nothing else builds a topic string or reads a
payload dict. Version 1 lives under ``phalanx/v1/`` (:data:`PREFIX`).

Topics (``{node}`` is a node id):

=====================================  =========  =======  ==========================
topic                                  publisher  retain   payload
=====================================  =========  =======  ==========================
``phalanx/v1/node/{node}/birth``       agent      yes      :class:`NodeBirth`
``phalanx/v1/node/{node}/death``       broker     yes      :class:`NodeDeath` (will)
``phalanx/v1/node/{node}/heartbeat``   agent      no       :class:`Heartbeat`
``phalanx/v1/node/{node}/cmd``         supervisor no       :class:`Command`
``phalanx/v1/node/{node}/ack``         agent      no       :class:`CommandAck`
``phalanx/v1/node/{node}/rank``        agent      no       :class:`RankEvent`,
                                                           :class:`RankEvents`
``phalanx/v1/node/{node}/ckpt``        agent      no       :class:`CkptLanding`,
                                                           :class:`CkptLandings`,
                                                           :class:`CkptReleased`
``phalanx/v1/node/{node}/metrics``     agent      no       :class:`MetricsBatch`
``phalanx/v1/job/{job}/ckpt/{node}``   supervisor yes      :class:`CkptCatalog`
``phalanx/v1/supervisor/status``       supervisor yes      :class:`SupervisorStatus`
=====================================  =========  =======  ==========================

Birth and death carry the agent's birth sequence number. A death only counts
for the birth with the same or an older sequence, so the retained pair read
back by a restarted supervisor tells it which of the two is newer.

Every inbound payload goes through :func:`parse`, which bounds its size,
checks it is JSON and validates it against the model of its topic. Anything
else raises :class:`WireError`; the daemons log it and drop the message.

The modules, by idea: ``_topics`` (every topic, built and matched), ``_node``
(a node's health, lifecycle and rank events), ``_metrics`` (training metrics batches),
``_ckpt`` (landings, releases,
catalogs), ``_commands`` (commands and acks), ``_codec`` (parse and encode),
``_base`` (the base model, id patterns and limits). This file is the surface.
"""

from phalanx.wire._base import (
    JOB_ID_PATTERN,
    MAX_I64,
    MAX_RANK,
    MAX_STEP,
    NODE_ID_PATTERN,
    JobId,
    NodeId,
)
from phalanx.wire._ckpt import (
    MAX_CATALOG_STEPS,
    MAX_LANDINGS_BATCHED,
    CkptCatalog,
    CkptLanding,
    CkptLandings,
    CkptPlan,
    CkptReleased,
    CkptReport,
    CkptShard,
    CkptStep,
    CkptTierName,
    PeerAddr,
    pack_landings,
)
from phalanx.wire._codec import MAX_PAYLOAD_BYTES, Inbound, Message, WireError, encode, parse
from phalanx.wire._commands import (
    AckStatus,
    AllocPortArgs,
    BurnInArgs,
    Command,
    CommandAck,
    CommandArgs,
    CommandArgsType,
    EnvFromFile,
    PingArgs,
    PrewarmArgs,
    ProbeLinkArgs,
    RankSlot,
    RebirthArgs,
    ResampleArgs,
    SaveNowArgs,
    StartRanksArgs,
    StopRanksArgs,
    WarmPlan,
)
from phalanx.wire._metrics import (
    MAX_METRIC_NAMES,
    MAX_METRIC_RANKS,
    METRICS_INTERVAL_S,
    SCALAR_NAME_PATTERN,
    MetricsBatch,
    RankWindow,
    ScalarStats,
)
from phalanx.wire._node import (
    FEATURE_PROBE_BOTH_WAYS,
    MAX_FLIGHT_POINTS,
    FlightPoint,
    GpuDescriptor,
    GpuGauges,
    Health,
    HealthStatus,
    Heartbeat,
    HostGauges,
    JobRanks,
    NodeBirth,
    NodeDeath,
    RankEvent,
    RankEvents,
    RankReport,
    Reason,
    SupervisorStatus,
    Topology,
    pack_rank_events,
)
from phalanx.wire._topics import (
    NODE_TOPIC_KINDS,
    PREFIX,
    SUPERVISOR_STATUS_TOPIC,
    SUPERVISOR_SUBSCRIPTIONS,
    ack_topic,
    agent_subscriptions,
    birth_topic,
    catalog_filter,
    catalog_prefix,
    catalog_topic,
    ckpt_topic,
    command_topic,
    death_topic,
    heartbeat_topic,
    match_node_topic,
    metrics_topic,
    rank_topic,
)

__all__ = [
    "FEATURE_PROBE_BOTH_WAYS",
    "JOB_ID_PATTERN",
    "MAX_CATALOG_STEPS",
    "MAX_FLIGHT_POINTS",
    "MAX_I64",
    "MAX_LANDINGS_BATCHED",
    "MAX_METRIC_NAMES",
    "MAX_METRIC_RANKS",
    "MAX_PAYLOAD_BYTES",
    "MAX_RANK",
    "MAX_STEP",
    "METRICS_INTERVAL_S",
    "NODE_ID_PATTERN",
    "NODE_TOPIC_KINDS",
    "PREFIX",
    "SCALAR_NAME_PATTERN",
    "SUPERVISOR_STATUS_TOPIC",
    "SUPERVISOR_SUBSCRIPTIONS",
    "AckStatus",
    "AllocPortArgs",
    "BurnInArgs",
    "CkptCatalog",
    "CkptLanding",
    "CkptLandings",
    "CkptPlan",
    "CkptReleased",
    "CkptReport",
    "CkptShard",
    "CkptStep",
    "CkptTierName",
    "Command",
    "CommandAck",
    "CommandArgs",
    "CommandArgsType",
    "EnvFromFile",
    "FlightPoint",
    "GpuDescriptor",
    "GpuGauges",
    "Health",
    "HealthStatus",
    "Heartbeat",
    "HostGauges",
    "Inbound",
    "JobId",
    "JobRanks",
    "Message",
    "MetricsBatch",
    "NodeBirth",
    "NodeDeath",
    "NodeId",
    "PeerAddr",
    "PingArgs",
    "PrewarmArgs",
    "ProbeLinkArgs",
    "RankEvent",
    "RankEvents",
    "RankReport",
    "RankSlot",
    "RankWindow",
    "Reason",
    "RebirthArgs",
    "ResampleArgs",
    "SaveNowArgs",
    "ScalarStats",
    "StartRanksArgs",
    "StopRanksArgs",
    "SupervisorStatus",
    "Topology",
    "WarmPlan",
    "WireError",
    "ack_topic",
    "agent_subscriptions",
    "birth_topic",
    "catalog_filter",
    "catalog_prefix",
    "catalog_topic",
    "ckpt_topic",
    "command_topic",
    "death_topic",
    "encode",
    "heartbeat_topic",
    "match_node_topic",
    "metrics_topic",
    "pack_landings",
    "pack_rank_events",
    "parse",
    "rank_topic",
]
