"""Training metrics, agent to supervisor: one compact batch per job per node per window.

An agent folds its ranks' step reports (``phalanx.rank.step``, one per step) into a
window of :data:`METRICS_INTERVAL_S` and sends one :class:`MetricsBatch` per job it runs,
never a message per step. The batch is bounded: at most :data:`MAX_METRIC_RANKS` ranks
(an agent with more ranks of a job sends several batches) and :data:`MAX_METRIC_NAMES`
scalar names per rank (names past the cap are counted in ``dropped_names``), which keeps
the largest batch (~140 KB with 64-character names) under the wire's ``MAX_PAYLOAD_BYTES``.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import ConfigDict, Field

from phalanx.wire._base import MAX_RANK, MAX_STEP, JobId, Msg, NodeId

METRICS_INTERVAL_S: Final = 5.0  # the agent's default window (``metrics_interval_s``)
MAX_METRIC_RANKS: Final = 64  # ranks per batch
MAX_METRIC_NAMES: Final = 16  # scalar names per rank and window
SCALAR_NAME_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_.]{0,63}$"

ScalarName = Annotated[str, Field(pattern=SCALAR_NAME_PATTERN)]
# (last, min, max, mean) of one scalar over a rank's window; NaN and infinities allowed
# (a NaN loss is news), written as JSON's common NaN/Infinity extension.
ScalarStats = tuple[float, float, float, float]


class RankWindow(Msg):
    """What one rank reported over one window.

    ``step_time_s``: mean seconds per step between the rank's reports (by the rank's own
    clock), including the interval from the previous window's last report; None when
    the window holds no interval (a first report). ``tokens_per_s``: the ``tokens``
    scalar (this rank's tokens per step) summed over those intervals, over their time.
    ``data_wait_s``: the mean of the ``data_wait_s`` scalar. ``scalars``: every other
    scalar's (last, min, max, mean), the last being the value at ``step_last``.
    """

    # The one message that may carry NaN and the infinities (every other is finite, see
    # Msg): in ``scalars`` only, each other float field refuses them itself.
    model_config = ConfigDict(
        extra="forbid", frozen=True, ser_json_inf_nan="constants", allow_inf_nan=True
    )

    rank: int = Field(ge=0, le=MAX_RANK)
    step_first: int = Field(ge=0, le=MAX_STEP)
    step_last: int = Field(ge=0, le=MAX_STEP)
    at: float = Field(
        allow_inf_nan=False, description="the rank's wall time of its report of step_last"
    )
    reports: int = Field(ge=1)
    step_time_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    tokens_per_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    data_wait_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    scalars: dict[ScalarName, ScalarStats] = Field(
        default_factory=dict, max_length=MAX_METRIC_NAMES
    )


class MetricsBatch(Msg):
    """One node's ranks of one job generation over one window (``window_s`` long)."""

    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")

    kind: Literal["metrics"] = "metrics"
    node: NodeId
    job: JobId
    generation: int = Field(ge=1)
    window_s: float = Field(ge=0, allow_inf_nan=False)
    sent_at: float = Field(allow_inf_nan=False)
    ranks: list[RankWindow] = Field(min_length=1, max_length=MAX_METRIC_RANKS)
    dropped_names: int = Field(default=0, ge=0, description="scalar names past the cap")
