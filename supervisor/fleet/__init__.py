"""The fleet wing: the nodes and what the supervisor says to them.

* `registry` — births, heartbeats, deaths and drains become node states, with events;
* `burnin` — a node joins the spares, or returns, only after a health test passes;
* `commands` — one command to one agent, and the wait for its ack;
* `mtbf` — the fleet's mean time between node failures (the ``auto`` interval).
"""
