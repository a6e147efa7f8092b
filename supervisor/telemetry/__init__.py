"""The telemetry wing: what the ranks say of their training.

* `training` — the metrics batches in, per-job bounded series, summaries, anomalies and
  stragglers out;
* `series` — the downsampling policy of a series; `rows` — its table in the store;
* `anomalies` — pure watches (NaN, spikes, stragglers) over the metrics;
* `slow_nodes` — nodes slow in several jobs at once (pure);
* `mfu` — model FLOPs utilisation from the FLOPs the ranks report;
* `wire_stats` — the messages the supervisor took, by kind, and the heartbeats' lag.
"""
