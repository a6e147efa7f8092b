"""The job spec: a YAML file an ML engineer writes, validated by pydantic.

See ``docs/jobspec.md`` for every field. Errors name the field and, where the
YAML gives one, the line: ``nodes (line 7): Input should be greater than 0``.
Secrets never travel or show in clear: an env value may be
``{from_file: /etc/...}``, read on the node when the ranks start, and shown
redacted everywhere else. ``team`` may be left out where the API token has a team
(:func:`validate_spec`'s ``default_team``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# Where a spec that names no team takes one: the API token's team (None: it has none).
TeamOf = Callable[[], str | None]

JOB_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
_MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
RESERVED_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
    }
)


class JobSpecError(ValueError):
    """A spec that cannot be used; ``errors`` holds ``(field, line, message)`` per problem."""

    def __init__(self, errors: list[tuple[str, int | None, str]]) -> None:
        self.errors = errors
        lines = [f"{f}{f' (line {ln})' if ln else ''}: {m}" for f, ln, m in errors]
        super().__init__("invalid job spec:\n  " + "\n  ".join(lines))


def parse_duration(value: Any) -> float:
    """``90``, ``"90s"``, ``"15m"``, ``"2h"``, ``"1.5d"`` → seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '2h'")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ValueError(f"{value!r} is not a duration (use e.g. 90, '90s', '15m', '2h')")
        seconds = float(match.group(1)) * _UNIT[match.group(2)]
    if seconds <= 0:
        raise ValueError("a duration must be positive")
    return seconds


class _Spec(BaseModel):
    # inf and nan are no duration, interval or count: YAML's .inf, 1e999 and a string of
    # 400 nines are refused as "Input should be a finite number".
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class FromFile(_Spec):
    """An env value read from a file on the node when the ranks start (a secret)."""

    from_file: Path = Field(description="Absolute path of the file on the node.")

    @field_validator("from_file")
    @classmethod
    def _absolute(cls, value: Path) -> Path:
        if not value.is_absolute():
            raise ValueError("from_file must be an absolute path on the node")
        return value


EnvValue = str | FromFile


class PlacementSpec(_Spec):
    policy: Literal["pack", "spread"] = Field(
        default="pack", description="pack: as few racks as possible; spread: one node per rack."
    )
    required: bool = Field(
        default=False, description="true: wait rather than start in a worse placement."
    )


class CheckpointSpec(_Spec):
    interval: (
        Literal["auto"]
        | Annotated[
            dict[Literal["steps", "seconds"], Annotated[float, Field(gt=0)]],
            Field(min_length=1, max_length=1),
        ]
    ) = Field(
        default="auto",
        description="`auto` (Young/Daly from the measured stall and the fleet's MTBF), "
        "`{steps: N}` or `{seconds: N}`.",
    )
    tiers: list[Literal["ram", "nvme", "peer", "object"]] = Field(
        default=["ram", "nvme", "peer", "object"],
        min_length=1,
        description="Tiers a checkpoint is written down to, nearest first.",
    )
    keep: dict[Literal["ram", "nvme", "peer", "object"], Annotated[int, Field(ge=1)]] = Field(
        default={"ram": 2, "nvme": 3, "peer": 2, "object": 5},
        description="Committed checkpoints kept per tier.",
    )


class RestartSpec(_Spec):
    max_restarts: int = Field(default=3, ge=0, description="Recoveries before the job fails.")
    use_spares: bool = Field(default=True, description="Move a failed node's ranks to a spare.")
    hang_timeout: float | None = Field(
        default=None,
        gt=0,
        description="Seconds without a step from any rank before the gang is hung; `auto` "
        "(null): 10x the median step time, never under 60 s. Needs `phalanx.rank.step`.",
    )
    spare_wait: float = Field(
        default=600.0,
        gt=0,
        description="How long a recovery waits for a spare or a healthy node before the job "
        "fails; seconds or '10m'.",
    )
    backoff: float = Field(
        default=1.0,
        ge=0,
        le=600,
        description="Seconds to wait before restarting a generation that a recovery started "
        "and that failed again within a minute without training a step (a crash loop); "
        "doubles with each such failure in a row, at most 60 s. Other restarts, and any "
        "after a hardware failure (its node quarantined and replaced), are immediate.",
    )

    warm: bool = Field(
        default=True,
        description="Keep warm interpreters on the job's nodes (Python started, `warm_imports` "
        "imported) that become its ranks at a restart, instead of a cold launch. Only a "
        "command `python script.py ...` or `python -m module ...` can use them; false: "
        "every start is a cold launch.",
    )
    warm_imports: list[Annotated[str, Field(pattern=_MODULE_PATTERN)]] = Field(
        default=["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo"],
        max_length=64,
        description="Modules a warm interpreter imports while it waits to become a rank. "
        "The default has what DistributedDataParallel imports when it is built "
        "(`torch._dynamo`: 1.5 s on a quiet core); a list of your own should keep it.",
    )

    in_process: bool = Field(
        default=False,
        description="In-process restart: when a rank exits, the others leave their "
        "collectives alive and become the next generation's ranks in the same process "
        "(the script runs its training under `phalanx.rank.run(train)`); only the failed "
        "rank's process is replaced. A rank that is not back within a few seconds is "
        "stopped and started as usual.",
    )

    @field_validator("hang_timeout", mode="before")
    @classmethod
    def _hang_timeout(cls, value: Any) -> Any:
        if value is None or value == "auto":
            return None
        return parse_duration(value)

    @field_validator("spare_wait", mode="before")
    @classmethod
    def _spare_wait(cls, value: Any) -> Any:
        return parse_duration(value)


class LrScaleSpec(_Spec):
    factor: float = Field(gt=0, le=10, description="What the learning rate is multiplied by.")
    steps: int = Field(ge=1, le=10**9, description="For this many steps after the skipped ones.")


class GuardSpec(_Spec):
    """The loss guard (``phalanx.guard``): a NaN, or a loss spike that lasts, rolls the
    gang back to a checkpoint before it and skips the data that led there."""

    ratio: float = Field(
        default=3.0, gt=1, le=1e6, description="A loss above ratio x its moving average spikes."
    )
    window: int = Field(
        default=100, ge=1, le=100_000, description="Steps in the moving average of the loss."
    )
    patience: int = Field(
        default=3, ge=1, description="Spiking steps in a row before the gang is rolled back."
    )
    margin: int = Field(
        default=0,
        ge=0,
        le=10**9,
        description="The checkpoint restored is at least this many steps older than the onset.",
    )
    max_rollbacks: int = Field(
        default=3, ge=0, le=10_000, description="Rollbacks within rollback_window; then it fails."
    )
    rollback_window: float = Field(
        default=86400.0, gt=0, description="The window max_rollbacks counts in; seconds or '24h'."
    )
    lr_scale: LrScaleSpec | None = Field(
        default=None, description="Scale the learning rate for a while after a rollback."
    )

    @field_validator("rollback_window", mode="before")
    @classmethod
    def _window(cls, value: Any) -> Any:
        return parse_duration(value)

    @field_validator("patience")
    @classmethod
    def _patience(cls, value: int, info: Any) -> int:
        window = info.data.get("window")
        if window is not None and value > window:
            raise ValueError(f"patience {value} is longer than the window ({window} steps)")
        return value

    @property
    def hold_steps(self) -> int:
        """How far back retention keeps a committed step (the window and the margin)."""
        return self.window + self.margin


# The validation context of a spec being submitted (:func:`validate_spec`), as opposed
# to one read back from the store: rules added since a job was submitted apply to new
# submissions only.
SUBMITTED: Final = "submitted"


class SdcSpec(_Spec):
    """Silent data corruption: the data-parallel replicas' parameter digests compared,
    within each group of ranks that hold bit-identical parameters."""

    every: int = Field(
        ge=1, le=10**9, description="Ranks report a digest of their parameters every N steps."
    )
    model_parallel: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Ranks that hold different parts of one replica of the model (tensor "
        "or pipeline parallel), numbered consecutively, as torch's DeviceMesh `(dp, mp)` "
        "numbers them: ranks r and r' are replicas of each other when r % model_parallel "
        "== r' % model_parallel. 1 (the default): pure data parallel, every rank is a "
        "replica of every other.",
    )
    groups: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=2)]] | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="The replica groups, listed, for a layout `model_parallel` does not "
        "describe: each a list of at least 2 ranks whose parameters are bit-identical. "
        "Ranks in no group are not compared.",
    )

    @field_validator("groups")
    @classmethod
    def _disjoint(cls, value: list[list[int]] | None) -> list[list[int]] | None:
        if value is None:
            return value
        seen: set[int] = set()
        for group in value:
            if len(set(group)) != len(group):
                raise ValueError(f"group {group} names a rank twice")
            if twice := seen & set(group):
                raise ValueError(f"rank {min(twice)} is in more than one group")
            seen |= set(group)
        return value

    def replica_groups(self, world_size: int) -> list[tuple[int, ...]]:
        """The groups of ranks whose digests must agree, in a gang of ``world_size``."""
        if self.groups is not None:
            return [tuple(sorted(g)) for g in self.groups]
        mp = self.model_parallel
        return [tuple(range(k, world_size, mp)) for k in range(min(mp, world_size))]

    def check(self, world_size: int, *, own_size: bool = True) -> None:
        """Raise ``ValueError`` naming what is wrong when the groups do not fit a gang of
        ``world_size`` ranks, or leave (at the job's own size) a lone replica. A smaller
        size of an elastic job may: its digests are then not compared."""
        if self.groups is not None and "model_parallel" in self.model_fields_set:
            raise ValueError("sdc: give either model_parallel or groups, not both")
        if self.groups is not None:
            far = max(r for g in self.groups for r in g)
            if far >= world_size:
                raise ValueError(f"sdc.groups names rank {far}, but the job has {world_size} ranks")
            return
        mp = self.model_parallel
        if world_size % mp:
            raise ValueError(
                f"sdc.model_parallel {mp} does not divide the job's {world_size} ranks"
            )
        if own_size and world_size // mp < 2:
            raise ValueError(
                f"sdc.model_parallel {mp} of {world_size} ranks leaves one replica: "
                "there is nothing to compare its digests with"
            )


# elastic.reshard: a catalog message of a resized gang lists every saved shard of its
# restore step (~250 bytes each: checksum, peer address and token) within half the
# wire's 256 KiB payload.
MAX_RESHARD_RANKS = 512


class ElasticSpec(_Spec):
    """Keep training on fewer nodes when a node is lost and none can take its ranks,
    with the same global batch (more gradient accumulation per rank), and grow back.

    A size of ``n`` nodes is allowed when ``global_batch`` is a multiple of
    ``micro_batch`` x the data-parallel size (``n`` x ``ranks_per_node``); each rank
    then accumulates ``global_batch / (micro_batch x n x ranks_per_node)`` micro
    batches per optimizer step. The job's own size (``nodes``) must be allowed."""

    min_nodes: int = Field(ge=1, le=4096, description="The fewest nodes the job runs on.")
    global_batch: int = Field(
        ge=1, le=10**9, description="Samples per optimizer step, the same at every size."
    )
    micro_batch: int = Field(
        ge=1, le=10**6, description="Samples per forward and backward pass of one rank."
    )
    prefer: Literal["spare", "shrink"] = Field(
        default="spare",
        description="`spare`: shrink only when no spare or idle node can take a lost "
        "node's ranks; `shrink`: shrink at once, never waiting for a node.",
    )
    state: Literal["replicated", "sharded"] = Field(
        default="replicated",
        description="`replicated`: every rank holds the whole training state (plain data "
        "parallel), so any rank's checkpoint restores any rank; `sharded` (FSDP, ZeRO, "
        "pipeline stages): each rank holds its own part, and the job changes size only "
        "with `reshard: true` (else it waits for a spare instead).",
    )
    reshard: bool = Field(
        default=False,
        description="With `state: sharded`: the ranks reshard the state themselves. A "
        "gang of another size than the one that saved the step it restores learns the "
        "saved layout (`Checkpointer.saved_layout()`) and reads the saved ranks' shards "
        "it needs (`Checkpointer.restore_shards(ranks, step)`); the restore step is one "
        "every node can read every saved shard of. Needs the object tier.",
    )
    grow_after: Annotated[float, Field(ge=0, le=7 * 86400)] = Field(
        default=300.0,
        description="Seconds a shrunk job runs at its size before it grows back onto "
        "returned nodes (a flapping node cannot thrash it); `5m`, `1h`.",
    )

    @field_validator("grow_after", mode="before")
    @classmethod
    def _grow_after(cls, value: Any) -> Any:
        return parse_duration(value)

    @model_validator(mode="after")
    def _reshard_needs_sharded(self) -> ElasticSpec:
        if self.reshard and self.state != "sharded":
            raise ValueError(
                "elastic.reshard is for state: sharded (each rank holds its own part); "
                "replicated state needs no resharding: any rank's shard restores any rank"
            )
        return self

    def sizes(self, nodes: int, ranks_per_node: int) -> list[int]:
        """The allowed node counts, from ``min_nodes`` up to ``nodes``, smallest first."""
        return [
            n
            for n in range(self.min_nodes, nodes + 1)
            if self.global_batch % (self.micro_batch * n * ranks_per_node) == 0
        ]

    def accumulation(self, nodes: int, ranks_per_node: int) -> int:
        """Micro batches each rank accumulates per optimizer step on ``nodes`` nodes."""
        return self.global_batch // (self.micro_batch * nodes * ranks_per_node)


class CodeRef(_Spec):
    """The code a job runs: ``phalanx submit`` fills it from the workdir's git checkout
    when the spec has none (``--code-ref`` overrides it)."""

    commit: str = Field(
        min_length=1, max_length=128, description="A git commit (or any version string)."
    )
    dirty: bool = Field(
        default=False, description="The tree had uncommitted changes when it was submitted."
    )
    source: str | None = Field(
        default=None, max_length=1024, description="Where the code lives (a repository URL)."
    )


HyperValue = Annotated[str, Field(max_length=1024)] | int | float | bool


class JobSpec(_Spec):
    name: str = Field(pattern=JOB_NAME_PATTERN, description="Lower-case name, used in job ids.")
    team: str = Field(min_length=1, max_length=64, description="Team charged for the GPUs.")
    priority: int = Field(default=50, ge=0, le=1000, description="Higher runs first.")
    command: list[str] = Field(min_length=1, description="argv of every rank.")
    workdir: str = Field(description="Working directory of the ranks, on the node.")
    env: dict[str, EnvValue] = Field(default_factory=dict, description="Extra environment.")
    nodes: int = Field(ge=1, le=4096, description="Whole nodes the gang needs.")
    ranks_per_node: int = Field(ge=1, le=64, description="Rank processes (GPUs) per node.")
    gpu_type: str | None = Field(default=None, description="GPU model the job needs, if any.")
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    max_runtime: Annotated[float, Field(gt=0)] = Field(
        default=86400.0, description="Seconds, or '90m', '2h', '3d'; the job fails past it."
    )
    preemptible: bool = Field(default=False, description="May be evicted by higher priority.")
    grace_period: float = Field(
        default=30.0, gt=0, le=3600, description="Seconds between SIGTERM and SIGKILL on stop."
    )
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    restart: RestartSpec = Field(default_factory=RestartSpec)
    guard: GuardSpec | None = Field(
        default_factory=GuardSpec,
        description="The loss guard (on by default); `off` (or null) turns it off.",
    )
    sdc: SdcSpec | None = Field(
        default=None,
        description="Compare the replicas' parameter digests every `every` steps (off by "
        "default); needs `phalanx.rank.digest`.",
    )
    elastic: ElasticSpec | None = Field(
        default=None,
        description="Shrink onto the healthy nodes, with the same global batch, when a "
        "node is lost and none can replace it; grow back when nodes return. Without it "
        "the job never changes size.",
    )
    # Lineage: what made this job's checkpoints (shown with them by `phalanx ckpt ls`).
    code_ref: CodeRef | None = Field(default=None, description="The code the job runs.")
    data_snapshot: str | None = Field(
        default=None, max_length=1024, description="The data it trains on (a snapshot id)."
    )
    hyperparams: dict[Annotated[str, Field(max_length=128)], HyperValue] = Field(
        default_factory=dict, max_length=256, description="Its hyperparameters, by name."
    )

    @field_validator("max_runtime", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float:
        return parse_duration(value)

    @field_validator("guard", mode="before")
    @classmethod
    def _guard(cls, value: Any) -> Any:
        # YAML reads `off`/`on` as booleans.
        if value is False or value == "off":
            return None
        if value is True or value == "on":
            return {}
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_numbers(cls, value: Any) -> Any:
        # `OMP_NUM_THREADS: 1` means the string "1"; a YAML boolean stays an error (yes/no/on).
        if isinstance(value, dict):
            return {
                k: (str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v)
                for k, v in value.items()
            }
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, EnvValue]) -> dict[str, EnvValue]:
        for key in value:
            if not _ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not a valid environment variable name")
            if key in RESERVED_ENV or key.startswith("PHALANX_"):
                raise ValueError(f"{key} is set by Phalanx for every rank and cannot be overridden")
        return value

    @field_validator("elastic")
    @classmethod
    def _elastic_sizes(cls, value: ElasticSpec | None, info: Any) -> ElasticSpec | None:
        nodes, per_node = info.data.get("nodes"), info.data.get("ranks_per_node")
        if value is None or nodes is None or per_node is None:
            return value
        if value.min_nodes > nodes:
            raise ValueError(f"min_nodes {value.min_nodes} is more than nodes ({nodes})")
        sizes = value.sizes(nodes, per_node)
        if nodes not in sizes:
            dp = nodes * per_node
            raise ValueError(
                f"global_batch {value.global_batch} is not a multiple of micro_batch "
                f"{value.micro_batch} x the data-parallel size {dp} ({nodes} nodes x "
                f"{per_node} ranks) at the job's own size; allowed sizes from min_nodes "
                f"{value.min_nodes} to {nodes}: "
                + (", ".join(map(str, sizes)) if sizes else "none")
            )
        if value.reshard and nodes * per_node > MAX_RESHARD_RANKS:
            raise ValueError(
                f"reshard supports jobs of up to {MAX_RESHARD_RANKS} ranks (after a resize "
                "every node's checkpoint catalog lists every saved shard), not "
                f"{nodes * per_node}; leave it out to have the job wait for a node instead"
            )
        return value

    @model_validator(mode="after")
    def _reshard_needs_the_object_tier(self) -> JobSpec:
        e = self.elastic
        if e is not None and e.reshard and "object" not in self.checkpoint.tiers:
            raise ValueError(
                "elastic.reshard needs the object tier in checkpoint.tiers: a resharding "
                "rank may read any saved shard, and after a lost node the shards it was "
                "the buddy of are left only on their own node"
            )
        return self

    @model_validator(mode="after")
    def _sdc_groups(self, info: ValidationInfo) -> JobSpec:
        if self.sdc is None:
            return self
        if self.elastic is not None and self.sdc.groups is not None:
            raise ValueError(
                "sdc.groups lists ranks of one size, and an elastic job changes size: "
                "use sdc.model_parallel"
            )
        # A lone replica is refused when the spec is submitted, not when a stored one is
        # read back (a job submitted before the rule keeps loading).
        submitted = bool(info.context and info.context.get(SUBMITTED))
        for nodes in self.elastic_sizes():
            self.sdc.check(nodes * self.ranks_per_node, own_size=submitted and nodes == self.nodes)
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def reshapes(self) -> bool:
        """Elastic with replicated state: its size may change, and any rank's checkpoint
        shard restores any rank."""
        return self.elastic is not None and self.elastic.state == "replicated"

    @property
    def reshards(self) -> bool:
        """Elastic with sharded state its ranks reshard: its size may change, and a rank
        of another size's gang reads the saved shards it needs."""
        return self.elastic is not None and self.elastic.reshard

    @property
    def resizes(self) -> bool:
        """Its size may change: elastic, and replicated or resharded by its ranks."""
        return self.reshapes or self.reshards

    def elastic_sizes(self) -> list[int]:
        """The node counts the job may run on, smallest first (only ``nodes`` when it is
        not elastic)."""
        if self.elastic is None:
            return [self.nodes]
        return self.elastic.sizes(self.nodes, self.ranks_per_node)

    def lineage(self) -> dict[str, Any]:
        """What made the job's checkpoints: its code, data snapshot and hyperparameters."""
        data = self.model_dump(mode="json", include={"code_ref", "data_snapshot", "hyperparams"})
        return data

    def redacted(self) -> dict[str, Any]:
        """The spec as the API and logs show it: file-backed env values stay references."""
        data = self.model_dump(mode="json")
        data["env"] = {
            k: (f"<from_file {v.from_file}>" if isinstance(v, FromFile) else v)
            for k, v in self.env.items()
        }
        return data


# What a spec may hold: a few dozen fields in a few levels. Past these the text is refused
# before it is built into values, so that no input costs more than a moment: a "billion
# laughs" of anchors and aliases stops at MAX_SPEC_NODES (aliases counted as often as they
# are used), nesting at MAX_SPEC_DEPTH (the YAML parser recurses once per level).
MAX_SPEC_CHARS: Final = 1 << 20
MAX_SPEC_DEPTH: Final = 32
MAX_SPEC_NODES: Final = 10_000


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses nesting past ``MAX_SPEC_DEPTH`` while it composes
    (before Python's recursion limit), and turns a scalar it cannot build (a 5000-digit
    integer, the date 2001-13-45, ``!!int abc``) into a ``ConstructorError`` at its line."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            return super().compose_node(parent, index)
        self._depth += 1
        try:
            if self._depth > MAX_SPEC_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested deeper than {MAX_SPEC_DEPTH} levels",
                    self.peek_event().start_mark,  # type: ignore[no-untyped-call]
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, OverflowError) as exc:
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {_shorter(str(node.value))!r}: {exc}", node.start_mark
            ) from exc


def _shorter(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def _check_size(root: yaml.Node, source: str) -> None:
    """Refuse a tree that, with every alias expanded, has more than ``MAX_SPEC_NODES``
    nodes or is nested deeper than ``MAX_SPEC_DEPTH``; walked without recursion, and
    stopped at the first node past a limit."""
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_SPEC_NODES:
            raise JobSpecError(
                [(source, None, f"more than {MAX_SPEC_NODES} values once its aliases expand")]
            )
        if depth > MAX_SPEC_DEPTH:
            line = node.start_mark.line + 1
            raise JobSpecError(
                [(source, line, f"nested deeper than {MAX_SPEC_DEPTH} levels through aliases")]
            )
        if isinstance(node, yaml.MappingNode):
            stack.extend((part, depth + 1) for pair in node.value for part in pair)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, depth + 1) for item in node.value)


def _line_index(node: yaml.Node, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], int]:
    lines = {path: node.start_mark.line + 1}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                continue  # the loader refuses such a key (unhashable) before this runs
            sub = (*path, key.value)
            lines[sub] = key.start_mark.line + 1
            lines.update({k: v for k, v in _line_index(value, sub).items() if k != sub})
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines.update(_line_index(item, (*path, i)))
    return lines


def field_errors(
    exc: ValidationError,
    lines: Mapping[tuple[Any, ...], int] | None,
    tags: frozenset[str] = frozenset({"str", "FromFile"}),
) -> list[tuple[str, int | None, str]]:
    """pydantic's errors as (field, line, message), one per field, its messages joined
    by "or"; pydantic's union-branch and discriminator ``tags`` (and ``dict[...]``,
    ``[key]``) left out of the field's name. ``lines``: each key path's line."""
    merged: dict[str, tuple[int | None, list[str]]] = {}
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in tags)))
        field = ".".join(str(p) for p in loc) or "<root>"
        line = None
        for cut in range(len(loc), 0, -1):
            if lines and loc[:cut] in lines:
                line = lines[loc[:cut]]
                break
        message = err["msg"].removeprefix("Value error, ")
        if message not in merged.setdefault(field, (line, []))[1]:
            merged[field][1].append(message)
    return [(f, ln, " or ".join(ms)) for f, (ln, ms) in merged.items()]


def load_mapping(
    text: str, *, source: str, what: str
) -> tuple[dict[str, Any], dict[tuple[str | int, ...], int]]:
    """YAML text as a mapping and the line of each key, within the size limits
    (``MAX_SPEC_CHARS``, ``MAX_SPEC_NODES`` with aliases expanded, ``MAX_SPEC_DEPTH``);
    raises :class:`JobSpecError`, and nothing else, for any text that is not such a
    mapping. ``what`` names the document in the error (``a job spec``)."""
    if len(text) > MAX_SPEC_CHARS:
        raise JobSpecError([(source, None, f"{len(text)} characters; at most {MAX_SPEC_CHARS}")])
    loader: _Loader | None = None
    try:
        loader = _Loader(text)  # refuses unprintable characters at once
        tree = loader.get_single_node()
        if tree is not None:
            _check_size(tree, source)
        data = loader.construct_document(tree) if tree is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise JobSpecError(
            [(source, mark.line + 1 if mark else None, f"not valid YAML: {exc.problem}")]
        ) from exc
    except yaml.YAMLError as exc:
        raise JobSpecError([(source, None, f"not valid YAML: {exc}")]) from exc
    finally:
        if loader is not None:
            loader.dispose()
    if not isinstance(data, dict):
        raise JobSpecError([(source, None, f"{what} is a mapping of fields")])
    return data, _line_index(tree) if tree is not None else {}


def load_spec(
    text: str, *, source: str = "job spec", default_team: TeamOf | None = None
) -> JobSpec:
    """Parse and validate YAML text; raises :class:`JobSpecError`, and nothing else, for
    any text: not YAML, too large (:func:`load_mapping`), or not a valid spec.
    ``default_team``: as :func:`validate_spec` takes it."""
    data, lines = load_mapping(text, source=source, what="a job spec")
    return validate_spec(data, lines=lines, default_team=default_team)


def validate_spec(
    data: dict[str, Any],
    *,
    lines: dict[tuple[Any, ...], int] | None = None,
    default_team: TeamOf | None = None,
) -> JobSpec:
    """``data`` as a :class:`JobSpec`, or :class:`JobSpecError` naming each bad field.

    ``default_team``: where a spec that names no ``team`` takes one (the API token's
    team: the supervisor's ``POST /v1/jobs``, the CLI's ``submit``); called only then.
    Without it, or when it gives None, such a spec is refused on field 'team'."""
    if default_team is not None and data.get("team") is None:
        team = default_team()
        if team is None:
            raise JobSpecError(
                [("team", None, "the spec names no team and the API token has none: add team")]
            )
        data = {**data, "team": team}
    try:
        return JobSpec.model_validate(data, context={SUBMITTED: True})
    except ValidationError as exc:
        raise JobSpecError(field_errors(exc, lines)) from exc


def load_spec_file(path: Path, *, default_team: TeamOf | None = None) -> JobSpec:
    try:
        text = path.read_text()
    except OSError as exc:
        raise JobSpecError([(str(path), None, f"cannot read: {exc.strerror}")]) from exc
    return load_spec(text, source=str(path), default_team=default_team)
