"""Who may use this agent's token routes: its rank logs and its peer tier's objects.

The agent holds its own per-node token ``t_X`` (``http.token_file``; see
``phalanx.agent_tokens``). A request is let in when its bearer token is

* ``t_X`` itself (the supervisor fetching a rank log, or anything with this node's own
  token): every token route; or
* on the peer routes only, the credential of the node named by its ``X-Phalanx-Node``
  header, ``HMAC(t_X, "phalanx peer v1:" + NODE)``, which the supervisor gave that node:
  a buddy pushing its copies, or a rank moved to another node restoring one.

Anything else is refused with 401 and a message saying what was missing or wrong (a
fleet-wide shared token, the form before per-node tokens, is named as such); with no
token configured every token route answers 403. Comparisons are constant-time.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from aiohttp import web

from phalanx.agent_tokens import NODE_HEADER, peer_credential
from phalanx.wire import NODE_ID_PATTERN

__all__ = ["Access", "Denied"]

_NODE_RE = re.compile(NODE_ID_PATTERN)


@dataclass(frozen=True)
class Denied:
    """Why a request may not use a token route, and the status to answer."""

    status: int
    message: str

    def response(self) -> web.Response:
        return web.json_response({"error": self.message}, status=self.status)


class Access:
    """This node's token routes' gate; ``token`` empty: none configured (all 403)."""

    def __init__(self, node: str, token: str) -> None:
        self.node = node
        self._token = token.encode()
        self._peers: dict[str, bytes] = {}  # node -> its credential here, derived once

    def __repr__(self) -> str:
        return f"Access(node={self.node!r})"

    def _credential(self, peer: str) -> bytes:
        found = self._peers.get(peer)
        if found is None:
            found = peer_credential(self._token.decode(), peer).encode()
            if len(self._peers) < 4096:  # bounded: the header is the caller's to choose
                self._peers[peer] = found
        return found

    def check(self, request: web.Request, *, peer_route: bool) -> Denied | None:
        """``None`` when ``request`` may use the route (``peer_route``: a peer-tier route,
        which buddies' credentials open too; else the rank-log route, which only this
        node's own token opens)."""
        if not self._token:
            return Denied(403, f"node {self.node} has no agent token (http.token_file)")
        given = request.headers.get("Authorization", "")
        if not given.startswith("Bearer ") or not given[7:].strip():
            return Denied(401, f"missing bearer token: node {self.node}'s token routes want one")
        bearer = given[7:].strip().encode()
        if hmac.compare_digest(bearer, self._token):
            return None
        peer = request.headers.get(NODE_HEADER)
        if peer is None:
            return Denied(
                401,
                f"wrong bearer token and no {NODE_HEADER} header: node {self.node} takes its "
                "own token (http.token_file), or on its peer routes a peer's credential "
                f"from the supervisor with {NODE_HEADER} naming that peer; a fleet-wide "
                "shared agent token is no longer accepted",
            )
        if not _NODE_RE.match(peer):
            return Denied(401, f"{NODE_HEADER}: invalid node id {peer[:80]!r}")
        if not peer_route:
            return Denied(401, f"a peer's credential does not open node {self.node}'s rank logs")
        if not hmac.compare_digest(bearer, self._credential(peer)):
            return Denied(
                401,
                f"wrong credential for node {peer} ({NODE_HEADER}) at node {self.node}: a "
                "node presents the one the supervisor sent it for this buddy",
            )
        return None
