"""The REST API wing: what operators, the CLI and the dashboard call over HTTP.

* `app` — the aiohttp application (``make_app``: the middlewares, the dashboard and
  each resource's routes), ``start_api``, and which error answers which status;
* `backend` — ``Backend``, what the API serves of the supervisor;
* `handlers` — what the route handlers share: the error answer, a request's JSON object;
* `access` — who a request is (bearer token or dashboard session) and whether it may
  do what it asks (the rule of every route, :data:`supervisor.api.access.RULES`);
* `node_routes` — the nodes: list, look, drain, undrain, ping;
* `job_routes` — the jobs: submit, list, look, cancel, logs, checkpoints, metrics;
* `job_pages` — ``GET /v1/jobs``'s filters and paging;
* `status_routes` — the supervisor's own state: ``/healthz``, ``/v1/leader``,
  ``/v1/events``, ``/v1/stats``, ``/metrics``;
* `prom` — ``GET /metrics``, the Prometheus view of the supervisor's state;
* `token_routes` — the routes an admin manages API tokens with;
* `sweep_routes` — the hyperparameter sweeps.

Only the daemon imports this wing; it imports the wings below it, never the daemon.
The route modules import ``backend``, ``handlers`` and ``access``, never ``app``.
"""
