"""The recovery wing: a failure in, a recovered (or ended) job out.

* `intake` — pure: a rank's exit, a node's state, a gang's hang reports in, a
  ``Report`` of the failure out (``rollbacks`` and ``sdc_watch`` make theirs);
* `planner` — pure: a failed job's state in, one decision out (restart in place, move
  ranks to a spare, wait, fail), no I/O and no clock;
* `executor` — begins a recovery from a report and carries its plan out through
  :class:`supervisor.actuator.Actuator`: stop, quarantine, burn-in, relaunch; it returns
  what the relaunch came to (the controller acts on it);
* `incidents` — the record of each recovery: phases, lost work, goodput.
"""
