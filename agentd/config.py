"""agentd's settings: ``/etc/phalanx/agentd.toml``, ``PHALANX_AGENTD_*``, flags.

See :mod:`phalanx.settings` for the precedence. Every threshold's default is
explained next to it; they follow what large GPU fleets drain on in practice
(NVIDIA's XID catalogue and DCGM's health checks).
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.settings import MqttSettings, ServerTls, load_settings
from phalanx.tls import check_ca_file, client_context
from phalanx.wire import NODE_ID_PATTERN

DEFAULT_CONFIG = Path("/etc/phalanx/agentd.toml")
ENV_PREFIX = "PHALANX_AGENTD_"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuSettings(_Section):
    backend: Literal["auto", "nvml", "sim"] = Field(
        default="auto",
        description="`nvml` reads real GPUs; `sim` reads a JSON file of simulated GPUs; "
        "`auto` uses nvml and refuses to start where NVML does not initialise.",
    )
    sim_file: Path | None = Field(
        default=None,
        description="The sim backend's JSON file (default: DATA_DIR/sim-gpus.json); created with "
        "`sim_gpus` healthy GPUs when missing, re-read at every sample.",
    )
    sim_gpus: int = Field(default=8, ge=0, le=64, description="GPUs in a new sim file.")
    sim_model: str = Field(default="Simulated H100 80GB HBM3", description="Model of sim GPUs.")
    sample_interval_s: float = Field(default=2.0, gt=0, description="Seconds between samples.")
    call_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A sample that takes longer means NVML hangs (a wedged driver); the node is "
        "drained with reason nvml_hang.",
    )


class Thresholds(_Section):
    drain_xids: list[int] = Field(
        default=[46, 48, 64, 74, 79, 95],
        description="XIDs that drain the node: 48 double-bit ECC, 79 fallen off the bus, "
        "74 NVLink error, 95 uncontained ECC, 64 ECC page retirement failure, "
        "46 GPU stopped processing.",
    )
    warn_xids: list[int] = Field(
        default=[13, 31, 43, 45, 63, 68, 92, 94, 109],
        description="XIDs that mark a node `warn`: mostly application faults (13, 31, 43, 45), "
        "contained ECC (63, 94), high SBE rate (92), context-switch timeout (109).",
    )
    xid_hold_s: float = Field(
        default=3600.0,
        ge=0,
        description="How long an XID keeps its reason after the event (events are one-shot; "
        "the health they signal is not).",
    )
    retired_pages_drain: int = Field(
        default=10,
        ge=0,
        description="More retired pages than this drains (NVIDIA's RMA guidance for "
        "pre-Ampere GPUs).",
    )
    sbe_rate_warn_per_hour: float = Field(
        default=100.0,
        gt=0,
        description="Corrected (single-bit) ECC errors per hour, over `sbe_window_s`, above "
        "which a GPU is `warn`: a rising rate precedes double-bit errors.",
    )
    sbe_window_s: float = Field(default=600.0, gt=0, description="Window of the SBE rate.")
    slowdown_sustain_s: float = Field(
        default=60.0,
        ge=0,
        description="Hardware or thermal slowdown lasting this long marks the GPU `warn` "
        "(a straggler suspect that slows the whole gang).",
    )
    disk_warn_fraction: float = Field(
        default=0.10, ge=0, le=1, description="Free fraction of the data disk below which: warn."
    )
    disk_drain_bytes: int = Field(
        default=2 * 1024**3,
        ge=0,
        description="Free bytes on the data disk below which checkpoints cannot land: drain.",
    )
    mem_warn_fraction: float = Field(
        default=0.05, ge=0, le=1, description="Available memory fraction below which: warn."
    )
    load_warn_per_cpu: float = Field(
        default=4.0, gt=0, description="1-minute load per CPU above which: warn."
    )


class HttpSettings(ServerTls):
    host: str = Field(default="0.0.0.0", description="Address the HTTP server binds.")
    port: int = Field(default=9400, ge=0, le=65535, description="HTTP port (0: any free port).")
    token_file: Path | None = Field(
        default=None,
        description="This node's own agent token, derived from the fleet agent secret "
        "(`phalanx agent-token --secret-file S NODE`): it opens this node's rank logs (the "
        "supervisor derives it to read them) and peer-tier routes, which also take a "
        "buddy's credential the supervisor sent it (`/healthz` and `/metrics` stay open). "
        "Unset: those routes answer 403.",
    )
    max_requests_per_peer: int = Field(
        default=32,
        ge=1,
        description="Requests one address may have in flight at once (a buddy's pushes "
        "and fetches, the supervisor's log reads, scrapes); past it: 429 until one ends.",
    )
    tls_ca_file: Path | None = Field(
        default=None,
        description="CA bundle that signed the other agents' HTTP certificates. An agent "
        "that serves HTTPS (`tls_cert_file`) speaks HTTPS to its peers (a fleet is all-TLS "
        "or not) and verifies them against this bundle; unset: the system's CA store.",
    )

    @field_validator("tls_ca_file")
    @classmethod
    def _ca_readable(cls, path: Path | None) -> Path | None:
        return None if path is None else check_ca_file(path)

    @model_validator(mode="after")
    def _ca_needs_tls(self) -> HttpSettings:
        if self.tls_ca_file is not None and not self.tls:
            raise ValueError(
                "tls_ca_file is set but this agent serves plain HTTP (no tls_cert_file): "
                "a fleet is all-TLS or not, and an agent speaks to its peers as it serves"
            )
        return self

    def peer_ssl(self) -> ssl.SSLContext | None:
        """What the peer tier verifies buddies with; ``None``: plain HTTP, as served."""
        return client_context(self.tls_ca_file) if self.tls else None


class RankSettings(_Section):
    pass_env: list[str] = Field(
        default_factory=list,
        description="Variables of the agent's own environment its ranks get all the same. "
        "By default a rank sees the agent's environment less the agent's settings "
        "(`PHALANX_AGENTD_*`, the broker password among them) and the object store's "
        "credentials (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`) "
        "and the CLI's `PHALANX_TOKEN`; "
        "a job that needs credentials gets them from its spec's `env` (`from_file`).",
    )

    @field_validator("pass_env")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        bad = [n for n in names if not n or "=" in n or "\0" in n]
        if bad:
            raise ValueError(f"not environment variable names: {bad}")
        return names


class CkptSettings(_Section):
    shm_dir: Path = Field(
        default=Path("/dev/shm"),
        description="tmpfs where the RAM tier's segments live (owned by the agent, so a "
        "checkpoint outlives its rank).",
    )
    object_store: str = Field(
        default="",
        description="The object tier: `s3://bucket/prefix` (endpoint and credentials from "
        "the usual AWS_* environment) or a folder (`file:///path`, shared by the fleet so "
        "any node restores from it). Empty: DATA_DIR/ckpt-objects.",
    )
    write_nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description="CPU niceness of the agent's write-down threads (checksums, disk writes, "
        "zstd). Measured with bench/checkpointing.py (1 GiB, 2 cores saturated by the training "
        "loop): nice 10 stretched the write-down from 6 s to 34 s without saving the loop "
        "any compute; nice 19 spared the loop but took 262 s. Raise it only where the "
        "ranks' CPU work matters more than how soon checkpoints are durable.",
    )
    write_cpus: list[int] = Field(
        default_factory=list,
        description="CPUs the agent's write-down runs on (its checkpoint writer threads and "
        "the threads that take a buddy's pushes), kept free of the ranks, which this "
        "node's agent starts on the other CPUs: the write-down off the training cores, on "
        "a node with cores to spare. Empty (the default): anywhere, ranks too.",
    )

    @field_validator("write_cpus")
    @classmethod
    def _usable_cpus(cls, cpus: list[int]) -> list[int]:
        if not cpus:
            return cpus
        usable = os.sched_getaffinity(0)
        if unknown := sorted(set(cpus) - usable):
            raise ValueError(
                f"CPU(s) {unknown} are not among this node's usable CPUs "
                f"({','.join(map(str, sorted(usable)))})"
            )
        if set(cpus) >= usable:
            raise ValueError("that leaves the ranks no CPU: keep at least one out of it")
        return sorted(set(cpus))

    compress_level: int = Field(
        default=1,
        ge=-7,
        le=22,
        description="zstd level of the peer and object tiers (negative: zstd's fast levels). "
        "Level 1 takes ~2.4 s of CPU per GiB on the reference machine.",
    )
    compress_min_saving: float = Field(
        default=0.10,
        ge=0.0,
        lt=1.0,
        description="The peer and object tiers compress a chunk (8 MiB) only when a 128 KiB "
        "sample of it shrinks by at least this fraction; other chunks go as raw zstd frames. "
        "fp32 noise saves 7.6% at level 1 (sent raw), bf16 22% (compressed). 0: always.",
    )
    peer_max_shard_bytes: int = Field(
        default=64 << 30,
        ge=1 << 20,
        description="The largest object a buddy may push to this node's peer tier, in bytes "
        "of content (a zstd body counts decompressed): a larger one is refused with 413 as "
        "soon as it crosses the limit, and nothing is stored. Default 64 GiB.",
    )
    catalog_wait_s: float = Field(
        default=20.0,
        gt=0,
        le=60,
        description="How long a restoring rank's question (which step, where) waits for the "
        "checkpoint catalog of the generation this node started, which the supervisor sends "
        "beside the start orders (at 2,048 nodes its catalogs take seconds); then the "
        "catalog this node has answers, with a warning, or the rank's restore fails "
        "without one.",
    )
    socket: Path | None = Field(
        default=None,
        description="The unix socket ranks reach the agent at (PHALANX_AGENT_SOCKET). "
        "Default: DATA_DIR/agent.sock, or a short name in the temp folder when that path is "
        "too long for a unix socket.",
    )


class AgentSettings(BaseSettings):
    """Everything agentd reads at start."""

    model_config = SettingsConfigDict(extra="forbid")

    node_id: str = Field(
        default_factory=lambda: socket.gethostname().split(".")[0],
        pattern=NODE_ID_PATTERN,
        description="This node's id in the fleet (default: the short host name).",
    )
    address: str = Field(
        default="",
        description="Address the supervisor, peers and other nodes' ranks reach this agent "
        "at (default: the address of the host name; where that is a loopback address and "
        "the broker is not, the address this host reaches the broker from).",
    )
    rack: str = Field(default="default", min_length=1, description="Rack label, for placement.")
    nvlink_domain: str | None = Field(default=None, description="NVLink domain (NVL72 etc.).")
    data_dir: Path = Field(
        default=Path("/var/lib/phalanx"), description="Logs, checkpoints, sim file, state."
    )
    heartbeat_interval_s: float = Field(
        default=5.0, gt=0, description="Seconds between heartbeats (health is also sent on change)."
    )
    metrics_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="Seconds of ranks' step reports folded into one training-metrics batch "
        "per job sent to the supervisor (agentd.metrics).",
    )
    stop_grace_s: float = Field(
        default=30.0,
        gt=0,
        description="When the agent itself stops, its ranks get SIGTERM and this long before "
        "SIGKILL (it never leaves orphaned ranks behind).",
    )
    outbox_max: int = Field(
        default=100_000,
        ge=100,
        le=10_000_000,
        description="Rank events and checkpoint landings each queue up to this many while "
        "the broker is out of reach or no supervisor leads (a few hundred bytes each); "
        "past it the oldest is dropped and counted (phalanx_outbox_dropped_total).",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_json: bool = Field(default=False, description="Log JSON lines instead of text.")
    mqtt: MqttSettings = Field(default_factory=MqttSettings)
    gpu: GpuSettings = Field(default_factory=GpuSettings)
    thresholds: Thresholds = Field(default_factory=Thresholds)
    http: HttpSettings = Field(default_factory=HttpSettings)
    ckpt: CkptSettings = Field(default_factory=CkptSettings)
    ranks: RankSettings = Field(default_factory=RankSettings)

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().absolute()

    def socket_path(self) -> Path:
        if self.ckpt.socket is not None:
            return self.ckpt.socket
        path = self.data_dir / "agent.sock"
        if len(str(path).encode()) <= 100:  # sun_path holds 108 bytes
            return path
        import tempfile

        import xxhash

        tag = xxhash.xxh64_hexdigest(str(self.data_dir).encode())[:12]
        return Path(tempfile.gettempdir()) / f"phalanx-{tag}-agent.sock"

    def sim_path(self) -> Path:
        return self.gpu.sim_file or self.data_dir / "sim-gpus.json"

    def advertised_address(self) -> str:
        """``address``; else the host name's address, unless that is a loopback one (Debian
        maps the host name to 127.0.1.1) while the broker is elsewhere: then the address
        this host reaches the broker from, which its peers can reach too."""
        if self.address:
            return self.address
        try:
            named = socket.gethostbyname(socket.gethostname())
        except OSError:
            named = "127.0.0.1"
        if not named.startswith("127."):
            return named
        return _source_address(self.mqtt.endpoints()[0][0]) or named


def _source_address(host: str) -> str | None:
    """The local address the kernel would send from to reach ``host`` (a UDP socket's
    connect sends nothing); None when ``host`` is loopback or unresolvable."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            local = str(probe.getsockname()[0])
    except OSError:
        return None
    return None if local.startswith("127.") or local == "0.0.0.0" else local


def load(argv: Sequence[str]) -> AgentSettings:
    return load_settings(
        AgentSettings,
        argv,
        prog="phalanx-agentd",
        env_prefix=ENV_PREFIX,
        default_config=DEFAULT_CONFIG,
    )
