"""The REST API wing: what operators, the CLI and the dashboard call over HTTP.

* `app` — the aiohttp application: its routes (``make_app``), ``start_api``;
* `access` — who a request is (bearer token or dashboard session) and whether it may
  do what it asks (the rule of every route, :data:`supervisor.api.access.RULES`);
* `token_routes` — the routes an admin manages API tokens with;
* `job_pages` — ``GET /v1/jobs``'s filters and paging;
* `prom` — ``GET /metrics``, the Prometheus view of the supervisor's state.

Only the daemon imports this wing; it imports the wings below it, never the daemon.
"""
