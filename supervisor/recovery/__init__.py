"""The recovery wing: a failure in, a recovered (or ended) job out.

* `planner` — pure: a failed job's state in, one decision out (restart in place, move
  ranks to a spare, wait, fail), no I/O and no clock;
* `executor` — carries a plan out through :class:`supervisor.actuator.JobControl`:
  stop, quarantine, burn-in, relaunch, and waits for its first step;
* `incidents` — the record of each recovery: phases, lost work, goodput.
"""
