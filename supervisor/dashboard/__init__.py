"""The web dashboard: a page app served by the supervisor beside its REST API.

Same port, same tokens: the browser asks for a token once and keeps a session cookie
(:mod:`supervisor.dashboard.session`); the API accepts it as well as the bearer header,
with that token's rights.
The page's assets (``static/``: plain JS modules, uPlot vendored with its licence) ship
in the package (:mod:`supervisor.dashboard.routes`).
"""

from supervisor.dashboard.routes import add_routes
from supervisor.dashboard.session import CSRF_HEADER, csrf_ok, session_of

__all__ = ["CSRF_HEADER", "add_routes", "csrf_ok", "session_of"]
