"""The supervisor's settings: ``/etc/phalanx/supervisor.toml``, ``PHALANX_SUPERVISOR_*``, flags.

Precedence as in :mod:`phalanx.settings`: flags > environment > file > defaults.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from phalanx.settings import ConfigError, MqttSettings, ServerTls, load_settings
from phalanx.tls import check_ca_file, client_context

DEFAULT_CONFIG = Path("/etc/phalanx/supervisor.toml")
ENV_PREFIX = "PHALANX_SUPERVISOR_"


class ApiSettings(ServerTls):
    host: str = Field(default="127.0.0.1", description="Address the REST API binds.")
    port: int = Field(default=8740, ge=0, le=65535, description="REST API port (0: any).")
    token: SecretStr | None = Field(default=None, description="Bearer token the CLI presents.")
    token_file: Path | None = Field(
        default=None, description="File holding the bearer token (preferred over `token`)."
    )


class TeamSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpu_quota: int | None = Field(default=None, ge=0, description="Hard cap on GPUs in use.")
    weight: float = Field(default=1.0, gt=0, description="Fair-share weight.")


class StoreSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        default="",
        description="The store's database: empty for SQLite at STATE_DIR/state.db (the "
        "default, for one host), or `postgresql://USER@HOST:PORT/DB` for PostgreSQL "
        "(libpq's URL: `?host=/run/postgresql` for a unix socket, `sslmode=...`). Keep "
        "the password out of it: libpq reads PGPASSFILE (or ~/.pgpass). The backups "
        "below are SQLite's; PostgreSQL is backed up with its own tools.",
    )

    backup_path: Path | None = Field(
        default=None,
        description="Folder of the store's rolling online backups: whole copies of "
        "state.db named state-<UTC time>.db, each checked with quick_check before it is "
        "renamed in place. Put it on another disk or a network mount, so that it outlives "
        "the state disk. Unset: STATE_DIR/backup.",
    )
    backup_interval_s: float = Field(
        default=300.0,
        ge=0,
        description="Seconds between two backups (the first once the newest one in the "
        "folder is this old, so restarts do not add any); 0: no backups.",
    )
    backup_url: str = Field(
        default="",
        description="An object store each sound backup is also uploaded to, as "
        "phalanx-store/state-<UTC time>.db under it, `backup_keep` kept there too: "
        "`s3://BUCKET/PREFIX` (endpoint and credentials as for the checkpoints' object "
        "store: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) or `file:///PATH`. Empty: the "
        "folder only.",
    )
    backup_keep: int = Field(
        default=12,
        ge=1,
        description="Backups kept: once a new one is in place the oldest beyond this are "
        "removed (a copy that fails its check never replaces one).",
    )

    @field_validator("backup_path")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser().absolute()

    @field_validator("backup_url")
    @classmethod
    def _object_store(cls, value: str) -> str:
        if value and not value.startswith(("s3://", "file:///")):
            raise ValueError(
                f"{value!r} is no object store URL: s3://BUCKET/PREFIX or file:///PATH"
            )
        if value.startswith("s3://") and not value[len("s3://") :].split("/", 1)[0]:
            raise ValueError(f"{value!r} names no bucket: s3://BUCKET/PREFIX")
        return value

    @field_validator("url")
    @classmethod
    def _postgresql(cls, value: str) -> str:
        if value and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError(
                "must be empty (SQLite under state_dir) or a postgresql:// URL, "
                f"not {value.split('://')[0]!r}"
            )
        return value


class HaSettings(BaseModel):
    """Leadership among supervisors that share a PostgreSQL store (supervisor.leadership).
    A supervisor on PostgreSQL always takes part: one leads, the others stand by."""

    model_config = ConfigDict(extra="forbid")

    lease_s: float = Field(
        default=4.0,
        ge=1.0,
        le=60.0,
        description="How long a leader that stopped answering (paused, frozen, cut off from "
        "PostgreSQL) keeps the lead: PostgreSQL ends its leadership session after this "
        "long idle (idle_session_timeout), and a standby takes over.",
    )
    poll_s: float = Field(
        default=1.0,
        gt=0,
        le=10.0,
        description="How often a standby tries to take the lead, and a leader renews it.",
    )
    api_url: str = Field(
        default="",
        description="The URL clients reach this supervisor's API at, which a standby names "
        "in its answers (header X-Phalanx-Leader) while this one leads. Empty: "
        "http(s)://HOSTNAME:PORT (the API's port, this host's name).",
    )


class SupervisorSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid")

    state_dir: Path = Field(
        default=Path("/var/lib/phalanx-supervisor"),
        description="Holds the SQLite store (state.db) and the sweeps' Optuna journal "
        "(sweeps.journal).",
    )
    offline_after_s: float = Field(
        default=15.0,
        gt=0,
        description="A node with no heartbeat for this long is offline even without a last "
        "will (a partition the broker has not noticed yet). Default: 3 heartbeats of 5s.",
    )
    command_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Wait for a command's ack; a supervisor behind on its messages waits "
        "that much longer (at most 60 s more): the ack may be among them.",
    )
    recovery_stop_wait_s: float = Field(
        default=1.0,
        ge=0,
        le=600,
        description="How long a recovery about to relaunch, which stopped the whole gang "
        "first (a backoff, a burn-in, a rollback, an elastic resize), waits for the stops' "
        "acks before it goes on all the same. A relaunch that follows at once stops only "
        "the nodes that leave the gang: each node that stays stops the job's old ranks "
        "before it starts the new (a save they commit after the plan is not restored from).",
    )
    schedule_interval_s: float = Field(
        default=2.0,
        gt=0,
        description="Longest time between scheduling passes (a submit, a "
        "job's end or a node change also start one).",
    )
    metrics_interval_s: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="Seconds between writes of the jobs' training metrics: one point per "
        "series and job (supervisor.telemetry.training).",
    )
    straggler_margin: float = Field(
        default=0.2,
        gt=0,
        description="A rank is a straggler when its step time stays above the gang's median "
        "by this fraction (0.2: 20% slower) ...",
    )
    straggler_windows: int = Field(
        default=6,
        ge=1,
        description="... for this many metrics intervals in a row.",
    )
    straggler_node_jobs: int = Field(
        default=2,
        ge=1,
        description="A node whose ranks are stragglers in at least this many jobs at once gets "
        "a `warn` reason `straggler` (supervisor.telemetry.slow_nodes): no new work lands on it "
        "until the flags clear or the jobs end. 1: a straggler in any one job is enough. Two jobs "
        "at once on one node means jobs that take part of a node's GPUs: on a fleet of "
        "whole-node jobs only 1 ever fires.",
    )
    gpu_peak_flops: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default_factory=dict,
        description="Peak FLOP/s of one GPU by its exact model name, for a job's MFU; models "
        "not named here use supervisor.telemetry.mfu.PEAKS (dense BF16 figures of known GPUs).",
    )
    spares: int = Field(default=0, ge=0, description="Healthy idle nodes held back as hot spares.")
    screen_max_slowdown: float = Field(
        default=0.05,
        gt=0,
        le=10,
        description="Pre-flight screening: a node whose slowest GPU's synthetic step, timed "
        "by its burn-in, is slower than the median of the nodes of its GPU model by more "
        "than this fraction (0.05: 5%) fails its burn-in and does not join "
        "(supervisor.fleet.screening).",
    )
    screen_min_link: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="... and one whose all-reduce between its GPUs runs under this fraction "
        "of their median bandwidth.",
    )
    screen_min_peers: int = Field(
        default=3,
        ge=1,
        description="... judged only once this many nodes of the model passed a burn-in "
        "that measured them (fewer: nothing to compare with, the node is not judged).",
    )
    screen_probe_bytes: int = Field(
        default=32 << 20,
        ge=0,
        le=1 << 30,
        description="The point-to-point probe: a node about to join a job as a replacement "
        "and a node of the job read this many bytes (for at most 2 s) from each other, and a "
        "burn-in does so with up to 3 idle nodes (agentd.linkprobe). 0: no probes; else at "
        "least 65536.",
    )

    @field_validator("screen_probe_bytes")
    @classmethod
    def _probe_bytes(cls, value: int) -> int:
        if 0 < value < 1 << 16:
            raise ValueError(f"{value} is too few to time: 0 (no probes) or at least 65536")
        return value

    screen_min_p2p: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="... a replacement whose link carries under this fraction of the median "
        "of the links probed within a day (once `screen_min_peers` were) does not join, and a "
        "burn-in whose links from 3 nodes do, by their median, fails.",
    )
    ckpt_node_mtbf_h: float = Field(
        default=5000.0,
        gt=0,
        description="A node's mean time between failures, in hours, for jobs checkpointing "
        "at `interval: auto` until enough failures are seen to learn it (5,000 h: about "
        "what large GPU fleets report, e.g. one interruption every ~3 h on 2,048 nodes).",
    )
    ckpt_mtbf_min_failures: int = Field(
        default=5,
        ge=1,
        description="Node failures (lost, or drained automatically) the event log must hold "
        "before the fleet's learned node MTBF replaces ckpt_node_mtbf_h.",
    )
    ckpt_failed_ram_linger_s: float = Field(
        default=0.0,
        ge=0,
        description="How long the nodes of a failed job keep its RAM checkpoint tier before "
        "they free it (the other tiers keep their copies). Nothing restarts a failed job, so "
        "by default it goes at once; a linger keeps the newest step in memory for a tool "
        "that restarts the failed gang's ranks by hand.",
    )
    teams: dict[str, TeamSettings] = Field(
        default_factory=dict, description="Per-team GPU quota and fair-share weight."
    )
    agent_token_file: Path | None = Field(
        default=None,
        description="The fleet agent secret (at least 16 characters; keep it on this host "
        "only): each node's agent token (its http.token_file) is derived from it "
        "(`phalanx agent-token`), and from that each node's credential at its buddies' "
        "peer tier, sent to that node alone. Used to fetch rank logs and in checkpoint "
        "plans and catalogs. Unset: rank logs cannot be fetched and the peer tier is "
        "refused.",
    )
    agent_tls: bool = Field(
        default=False,
        description="Reach the agents' HTTP (rank logs) over HTTPS: set it when the agents "
        "serve TLS (their http.tls_cert_file).",
    )
    agent_ca_file: Path | None = Field(
        default=None,
        description="CA bundle that signed the agents' HTTP certificates (needs agent_tls); "
        "unset: the system's CA store.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_json: bool = Field(default=False, description="Log JSON lines instead of text.")
    mqtt: MqttSettings = Field(default_factory=MqttSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    ha: HaSettings = Field(default_factory=HaSettings)

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        return value.expanduser().absolute()

    @field_validator("agent_ca_file")
    @classmethod
    def _ca_readable(cls, path: Path | None) -> Path | None:
        return None if path is None else check_ca_file(path)

    @model_validator(mode="after")
    def _ca_needs_tls(self) -> SupervisorSettings:
        if self.agent_ca_file is not None and not self.agent_tls:
            raise ValueError(
                "agent_ca_file is set but agent_tls is not: set agent_tls = true to reach "
                "the agents over HTTPS"
            )
        return self

    def backup_dir(self) -> Path | None:
        """Where the store's backups go; None: no backups (``store.backup_interval_s`` 0,
        or the store is PostgreSQL's)."""
        if self.store.backup_interval_s == 0 or self.store.url:
            return None
        return self.store.backup_path or self.state_dir / "backup"

    def agent_ssl(self) -> ssl.SSLContext | None:
        """What the supervisor verifies agents with; ``None``: plain HTTP."""
        return client_context(self.agent_ca_file) if self.agent_tls else None

    def api_token(self) -> str:
        if self.api.token_file is not None:
            try:
                token = self.api.token_file.read_text().strip()
            except OSError as exc:
                raise ConfigError(
                    f"api.token_file: cannot read {self.api.token_file}: {exc}"
                ) from exc
        elif self.api.token is not None:
            token = self.api.token.get_secret_value()
        else:
            raise ConfigError(
                "api.token: no API token configured (set api.token_file or "
                "api.token); the REST API never runs open"
            )
        if len(token) < 16:
            raise ConfigError("api.token: the API token must be at least 16 characters")
        return token


def load(argv: Sequence[str]) -> SupervisorSettings:
    return load_settings(
        SupervisorSettings,
        argv,
        prog="phalanx-supervisor",
        env_prefix=ENV_PREFIX,
        default_config=DEFAULT_CONFIG,
    )
