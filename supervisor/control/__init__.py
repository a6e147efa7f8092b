"""The control wing: jobs from submission to their end.

* `controller` — the job controller: the queue, scheduling passes, gang launch, rank
  exits, stops; it implements :class:`supervisor.actuator.JobControl`;
* `orders` — what a gang's nodes are told: start orders, stops, preemption;
* `reconcile` — the jobs against what the fleet reports of them, both ways;
* `cluster` — the fleet and the jobs as the pure scheduler sees them.

Failures go from here to :mod:`supervisor.recovery`; recovery acts back only through
the actuator, never by importing this wing.
"""
