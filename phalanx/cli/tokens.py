"""``phalanx token``: an admin makes, lists and revokes the API's tokens (the
supervisor's ``/v1/tokens``); any token asks who it is (``phalanx token whoami``).

``create`` prints the new secret once, on stdout, and says on stderr that it will not be
shown again: the supervisor keeps only its hash.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from phalanx.cli.base import EXIT_OK, emit, table
from phalanx.client import Client

ClientOf = Callable[[argparse.Namespace], Client]
Call = Callable[..., Any]


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _what(t: dict[str, Any]) -> str:
    return f"{t['role']} of team {t['team']}" if t.get("team") else str(t["role"])


def add_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    out: Callable[[argparse.ArgumentParser], None],
    client_of: ClientOf,
    call: Call,
) -> None:
    """The ``token`` command and its subcommands, under ``sub``; ``client_of`` makes the
    API client of the parsed arguments, ``call`` maps an API error to an exit code."""

    def cmd_create(args: argparse.Namespace) -> int:
        body: dict[str, Any] = {"role": args.role}
        for field in ("team", "name", "expires"):
            if getattr(args, field) is not None:
                body[field] = getattr(args, field)
        made = call(client_of(args).post, "/v1/tokens", body)
        if args.output == "json":
            emit(args, made, "")
        else:
            print(made["secret"])
        print(
            f"token {made['id']} ({made['name']}, {_what(made)}, expires "
            f"{_when(made.get('expires_at'))}) created; its secret is printed above and will "
            "not be shown again",
            file=sys.stderr,
        )
        return EXIT_OK

    def cmd_ls(args: argparse.Namespace) -> int:
        found: list[dict[str, Any]] = call(client_of(args).get, "/v1/tokens")
        rows = [
            [
                t["id"],
                t["name"],
                t["role"],
                t.get("team") or "-",
                t["state"],
                _when(t["created_at"]),
                _when(t.get("expires_at")),
                _when(t.get("revoked_at")),
            ]
            for t in found
        ]
        emit(
            args,
            found,
            table(rows, ["ID", "NAME", "ROLE", "TEAM", "STATE", "CREATED", "EXPIRES", "REVOKED"]),
        )
        return EXIT_OK

    def cmd_revoke(args: argparse.Namespace) -> int:
        done = call(client_of(args).post, f"/v1/tokens/{args.id}/revoke")
        print(f"token {done['id']} ({done['name']}) revoked", file=sys.stderr)
        return EXIT_OK

    def cmd_whoami(args: argparse.Namespace) -> int:
        me = call(client_of(args).get, "/v1/whoami")
        emit(args, me, f"{me['id']} ({me['name']}): {_what(me)}, expires {_when(me['expires_at'])}")
        return EXIT_OK

    tp = sub.add_parser("token", help="the API's tokens: create, list, revoke (admin)")
    tsub = tp.add_subparsers(dest="token_command", required=True)
    sp = tsub.add_parser("create", help="make a token; prints its secret, once")
    sp.add_argument("--role", required=True, choices=["admin", "operator", "member", "viewer"])
    sp.add_argument("--team", help="the token's team (a member's is required)")
    sp.add_argument("--expires", metavar="DURATION", help="e.g. 30d, 12h (default: never)")
    sp.add_argument("--name", metavar="LABEL", help="a label (default: the token's id)")
    out(sp)
    sp.set_defaults(fn=cmd_create)
    sp = tsub.add_parser("ls", help="every token, its role, team and state (never secrets)")
    out(sp)
    sp.set_defaults(fn=cmd_ls)
    sp = tsub.add_parser("revoke", help="end a token and its dashboard sessions")
    sp.add_argument("id", help="the token's id (t1, t2, ...)")
    sp.set_defaults(fn=cmd_revoke)
    sp = tsub.add_parser("whoami", help="the token this CLI uses: id, role, team, expiry")
    out(sp)
    sp.set_defaults(fn=cmd_whoami)
