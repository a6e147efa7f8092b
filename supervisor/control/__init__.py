"""The control wing: jobs from submission to their end.

* `controller` — the job controller: the queue, scheduling passes, rank exits, stops;
  it routes every failure to recovery (``route``) and acts on what a launch came to;
* `orders` — what a gang's nodes are told: start orders, the save before a preemption;
* `reconcile` — the jobs against what the fleet reports of them, both ways;
* `cluster` — the fleet and the jobs as the pure scheduler sees them.

Failures go from here to :mod:`supervisor.recovery`; recovery acts only through
:mod:`supervisor.actuator`, which this wing shares, never by importing or calling it.
"""
