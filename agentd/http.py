"""agentd's HTTP server: ``/healthz`` and Prometheus ``/metrics``; HTTPS when
``http.tls_cert_file`` and ``http.tls_key_file`` are set.

The supervisor reads rank logs here; buddies push and fetch the peer tier's
checkpoint copies (``agentd.ckpt.peer_routes``). Both are behind this node's own agent
token (``http.token_file``: a per-node token, ``phalanx.agent_tokens``), which the
supervisor derives to fetch logs; the peer routes also take a buddy's credential for
this node, with ``X-Phalanx-Node`` naming the buddy (``agentd.access``). Nothing opens
the rank-log route but this node's own token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agentd.access import Access
from agentd.ckpt import add_peer_routes
from agentd.ckpt.host import CkptHost
from agentd.config import AgentSettings
from agentd.gpu.base import GpuBackend, GpuInfo
from agentd.linkprobe import add_probe_route
from agentd.metrics import MetricsWindow
from agentd.progress import ProgressMonitor
from agentd.ranks import RankRunner
from phalanx import wire
from phalanx.http import per_peer_limit, serve
from phalanx.wire import JOB_ID_PATTERN

log = logging.getLogger(__name__)
_STATUS_VALUE = {"ok": 0, "warn": 1, "drain": 2}
MAX_BODY_BYTES = 1 << 20


class Agent(CkptHost, Protocol):
    """What the HTTP server reads of the agent (``agentd.daemon.Agent`` is one): its
    health, link, GPUs, ranks' logs, progress and metrics counters, settings, and what
    the checkpoint routes need. Nothing here imports the daemon."""

    settings: AgentSettings
    health: wire.Health
    inventory: list[GpuInfo]
    backend: GpuBackend
    http_token: str
    ranks: RankRunner
    metrics: MetricsWindow
    metrics_sent: int

    @property
    def metrics_dropped(self) -> int: ...

    @property
    def rank_events(self) -> _Outbox: ...

    @property
    def landings(self) -> _Outbox: ...

    @property
    def link(self) -> _Link: ...

    @property
    def progress(self) -> ProgressMonitor: ...


class _Link(Protocol):
    @property
    def connected(self) -> bool: ...


class _Outbox(Protocol):
    dropped: int

    def __len__(self) -> int: ...


class _AgentCollector(Collector):
    """Reads the agent's latest health at scrape time; nothing is cached twice."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        node = a.node
        status = GaugeMetricFamily(
            "phalanx_node_health", "Node health: 0 ok, 1 warn, 2 drain", labels=["node"]
        )
        status.add_metric([node], _STATUS_VALUE[a.health.status.value])
        yield status
        reasons = GaugeMetricFamily(
            "phalanx_health_reason",
            "Active health reasons (1 each)",
            labels=["node", "code", "severity", "gpu"],
        )
        for r in a.health.reasons:
            reasons.add_metric([node, r.code, r.severity, "" if r.gpu is None else str(r.gpu)], 1)
        yield reasons
        link = GaugeMetricFamily(
            "phalanx_mqtt_connected", "1 while the broker link is up", labels=["node"]
        )
        link.add_metric([node], 1 if a.link.connected else 0)
        yield link
        gauges = {
            "temperature_c": ("phalanx_gpu_temperature_celsius", "GPU temperature"),
            "power_w": ("phalanx_gpu_power_watts", "GPU power draw"),
            "util_pct": ("phalanx_gpu_utilization_percent", "GPU utilisation"),
            "mem_used_bytes": ("phalanx_gpu_memory_used_bytes", "GPU memory used"),
            "ecc_sbe_volatile": ("phalanx_gpu_ecc_sbe_volatile", "Corrected ECC errors"),
            "ecc_dbe_volatile": ("phalanx_gpu_ecc_dbe_volatile", "Uncorrected ECC errors"),
            "retired_pages": ("phalanx_gpu_retired_pages", "Retired memory pages"),
        }
        for field, (name, doc) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=["node", "gpu"])
            for g in a.health.gpus:
                value = getattr(g, field)
                if value is not None:
                    family.add_metric([node, str(g.index)], float(value))
            yield family
        for name, doc, value in (
            (
                "phalanx_progress_reports",
                "Ranks' step reports taken (phalanx.rank.step)",
                a.progress.received,
            ),
            (
                "phalanx_progress_garbage",
                "Datagrams on the progress socket that were no report",
                a.progress.garbage,
            ),
            (
                "phalanx_metrics_batches_sent",
                "Training-metrics batches queued to send",
                a.metrics_sent,
            ),
            (
                "phalanx_metrics_batches_dropped",
                "Training-metrics batches dropped: the outbox was full",
                a.metrics_dropped,
            ),
            (
                "phalanx_metrics_names_dropped",
                "Scalar values left out of metrics batches: past the names cap",
                a.metrics.dropped_names,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["node"])
            counter.add_metric([node], value)
            yield counter
        queued = GaugeMetricFamily(
            "phalanx_outbox_queued",
            "Messages waiting to reach the broker (and a supervisor)",
            labels=["node", "outbox"],
        )
        dropped = CounterMetricFamily(
            "phalanx_outbox_dropped",
            "Messages dropped from a full outbox (the oldest first; agentd outbox_max)",
            labels=["node", "outbox"],
        )
        for name, box in (("rank_events", a.rank_events), ("landings", a.landings)):
            queued.add_metric([node, name], len(box))
            dropped.add_metric([node, name], box.dropped)
        yield queued
        yield dropped
        host = a.health.host
        if host is not None:
            for name, doc, value in (
                (
                    "phalanx_host_disk_free_bytes",
                    "Free bytes on the data disk",
                    host.disk_free_bytes,
                ),
                (
                    "phalanx_host_memory_available_bytes",
                    "Available memory",
                    host.mem_available_bytes,
                ),
                ("phalanx_host_load1", "1-minute load average", host.load1),
            ):
                family = GaugeMetricFamily(name, doc, labels=["node"])
                family.add_metric([node], float(value))
                yield family


def make_app(agent: Agent) -> web.Application:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_AgentCollector(agent))

    async def healthz(request: web.Request) -> web.Response:
        body = {
            "node": agent.node,
            "status": agent.health.status.value,
            "reasons": [r.model_dump() for r in agent.health.reasons],
            "mqtt_connected": agent.link.connected,
            "gpus": len(agent.inventory),
            "backend": agent.backend.name,
        }
        return web.json_response(body)

    access = Access(agent.node, agent.http_token)

    async def rank_log(request: web.Request) -> web.Response:
        if (denied := access.check(request, peer_route=False)) is not None:
            return denied.response()
        job = request.match_info["job"]
        if not re.match(JOB_ID_PATTERN, job):
            return web.json_response({"error": f"invalid job id {job!r}"}, status=400)
        try:
            rank = int(request.match_info["rank"])
            offset = max(0, int(request.query.get("offset", "0")))
            limit = min(4 * 2**20, max(1, int(request.query.get("limit", str(2**20)))))
        except ValueError:
            return web.json_response(
                {"error": "rank, offset and limit must be integers"}, status=400
            )
        path = agent.ranks.log_path(job, rank)
        if path is None or not path.exists():
            return web.json_response(
                {"error": f"no log of job {job} rank {rank} on node {agent.node}"}, status=404
            )
        data, size = await asyncio.to_thread(_read_slice, path, offset, limit)
        return web.Response(
            body=data,
            content_type="text/plain",
            headers={"X-Phalanx-Offset": str(offset + len(data)), "X-Phalanx-Size": str(size)},
        )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    # The largest body read whole here: a peer delete's list of keys. The peer tier's
    # pushes stream past it, capped by their own route.
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=[per_peer_limit(agent.settings.http.max_requests_per_peer)],
    )
    add_peer_routes(app, agent, access, max_shard_bytes=agent.settings.ckpt.peer_max_shard_bytes)
    add_probe_route(app, access)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/jobs/{job}/ranks/{rank}/log", rank_log)
    return app


def _read_slice(path: Path, offset: int, limit: int) -> tuple[bytes, int]:
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        fh.seek(min(offset, size))
        return fh.read(limit), size


@contextlib.asynccontextmanager
async def start_http(agent: Agent) -> AsyncIterator[int]:
    """Serve until the block ends; yields the bound port (useful with port 0)."""
    host, port = agent.settings.http.host, agent.settings.http.port
    tls = agent.settings.http.server_ssl()  # None: plain HTTP
    async with serve(
        make_app(agent),
        lambda runner: web.TCPSite(runner, host, port, ssl_context=tls),
        f"agent HTTP{'S' if tls else ''} server on {host}:{port}",
    ) as runner:
        yield int(runner.addresses[0][1])
