"""The agents' per-node HTTP tokens, and the credentials a node presents to a buddy.

One fleet secret ``S`` (the supervisor's ``agent_token_file``) lives on the supervisor's
host only. From it:

* node X's token ``t_X = HMAC-SHA256(S, "phalanx node token v1:" + X)`` (hex) is what X
  keeps in its ``http.token_file``; it opens X's own rank-log and peer routes (the
  supervisor, which can derive every ``t_X``, fetches rank logs with it);
* node A's credential at buddy X, ``k = HMAC-SHA256(t_X, "phalanx peer v1:" + A)`` (hex),
  presented as the bearer token with ``X-Phalanx-Node: A``, opens X's peer routes as A,
  and nothing else. X checks it by deriving it from its own ``t_X``: nothing is handed
  to X. The supervisor computes it and sends it to A only, inside the ``wire.PeerAddr``
  of A's checkpoint plan and catalog.

So a token read on one node opens that node alone, and a credential that leaks from A's
messages opens X's peer routes as A only (never X's logs, never another node).

``phalanx agent-token --secret-file S NODE`` prints ``t_NODE`` (what the Ansible role and
the rig install on each node); ``new_secret`` makes an ``S``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import re
import secrets
import sys
from pathlib import Path
from typing import Final

from phalanx.wire import NODE_ID_PATTERN

__all__ = [
    "NODE_HEADER",
    "AgentKeys",
    "add_parser",
    "new_secret",
    "node_token",
    "peer_credential",
    "read_secret",
]

NODE_HEADER: Final = "X-Phalanx-Node"  # the node a peer's request speaks for
_NODE_CONTEXT: Final = "phalanx node token v1:"
_PEER_CONTEXT: Final = "phalanx peer v1:"
_NODE_RE: Final = re.compile(NODE_ID_PATTERN)


def _hmac(key: str, message: str) -> str:
    return hmac.new(key.encode(), message.encode(), hashlib.sha256).hexdigest()


def _node(node: str) -> str:
    if not _NODE_RE.match(node):
        raise ValueError(f"invalid node id {node!r}")
    return node


def node_token(secret: str, node: str) -> str:
    """``t_NODE``: the HTTP token of ``node`` derived from the fleet secret."""
    if not secret:
        raise ValueError("no fleet agent secret: cannot derive a node's token")
    return _hmac(secret, _NODE_CONTEXT + _node(node))


def peer_credential(holder_token: str, peer: str) -> str:
    """What node ``peer`` presents to the node whose token is ``holder_token`` (with
    ``X-Phalanx-Node: peer``) to use that node's peer routes."""
    if not holder_token:
        raise ValueError("no node token: cannot derive a peer's credential")
    return _hmac(holder_token, _PEER_CONTEXT + _node(peer))


def new_secret() -> str:
    """A fresh fleet agent secret (256 bits, hex)."""
    return secrets.token_hex(32)


def read_secret(path: Path) -> str:
    """The fleet secret in ``path`` (stripped); ``ValueError`` naming the file when it
    cannot be read or is shorter than 16 characters."""
    try:
        secret = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the fleet agent secret {path}: {exc}") from exc
    if len(secret) < 16:
        raise ValueError(f"the fleet agent secret in {path} is under 16 characters")
    return secret


class AgentKeys:
    """The supervisor's view of the fleet secret: any node's token, and any node's
    credential at a buddy. Derived values are kept (a catalog for a big job asks for the
    same pair many times); the secret never shows in a repr."""

    def __init__(self, secret: str) -> None:
        self._secret = secret
        self._tokens: dict[str, str] = {}
        self._credentials: dict[tuple[str, str], str] = {}

    def __repr__(self) -> str:
        return f"AgentKeys(configured={bool(self._secret)})"

    def __bool__(self) -> bool:
        return bool(self._secret)

    def node_token(self, node: str) -> str:
        """``t_NODE``; ``ValueError`` when no secret is configured."""
        found = self._tokens.get(node)
        if found is None:
            found = self._tokens[node] = node_token(self._secret, node)
        return found

    def peer_credential(self, holder: str, peer: str) -> str | None:
        """What ``peer`` presents at ``holder``'s peer routes; ``None`` when no secret is
        configured (the holder then refuses ``peer``, and says why)."""
        if not self._secret:
            return None
        found = self._credentials.get((holder, peer))
        if found is None:
            found = peer_credential(self.node_token(holder), peer)
            self._credentials[(holder, peer)] = found
        return found


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``agent-token`` command, under ``sub``."""
    sp = sub.add_parser(
        "agent-token",
        help="print a node's agent HTTP token (its http.token_file), derived from the "
        "fleet agent secret",
    )
    sp.add_argument(
        "--secret-file",
        type=Path,
        required=True,
        help="the fleet agent secret (the supervisor's agent_token_file)",
    )
    sp.add_argument("node", help="the node's id (its node_id)")
    sp.set_defaults(fn=_cmd_agent_token)


def _cmd_agent_token(args: argparse.Namespace) -> int:
    try:
        token = node_token(read_secret(args.secret_file), args.node)
    except ValueError as exc:
        print(f"phalanx: {exc}", file=sys.stderr)
        return 2
    print(token)
    return 0
