"""The REST API's tokens: created and revoked by an admin, stored hashed, checked per
request.

A token's secret is ``phx_<id>_<random>``: the id (``t1``, ``t2``, ...) lets the
supervisor find the token's row without scanning, the random part (32 bytes from
``secrets``, URL-safe base64) is what makes it a secret. The store keeps the SHA-256 of
the whole secret, never the secret; a request's secret is hashed and compared with the
row's in constant time.

Why a plain SHA-256 and not bcrypt or argon2: those are slow on purpose, to protect
passwords people choose, which are guessable. A 256-bit random secret cannot be guessed,
however fast the hash, so slowness would only cost every request its latency; a
leaked database still gives nobody a usable token.

The secret is shown once, in the answer that creates it: ``GET /v1/tokens`` shows a
token's id, name, role, team and dates, never its secret or hash.

The bootstrap token of ``api.token_file`` (or ``api.token``) is not in the store: it is
the admin token ``bootstrap``, valid while it is in the settings, so a fleet keeps its
one token until an admin makes others (``phalanx token create``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from phalanx.jobspec import parse_duration
from supervisor.auth.roles import Role
from supervisor.auth.rows import TokenRows
from supervisor.errors import Refused, Unauthorized, UnknownToken
from supervisor.store import Store

PREFIX = "phx"
SECRET_BYTES = 32  # of randomness per secret: 256 bits
BOOTSTRAP_ID = "bootstrap"
MAX_EXPIRY_S = 10 * 365 * 86400.0
_ID = re.compile(r"^t[1-9][0-9]{0,17}$")
_NAME = r"^[A-Za-z0-9][A-Za-z0-9 ._@+-]{0,63}$"
_TEAM = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


def digest(secret: str) -> str:
    """The hex SHA-256 of a secret, as the store keeps it."""
    return hashlib.sha256(secret.encode()).hexdigest()


def when(ts: float) -> str:
    """A time as denials and ``phalanx token ls`` write it: ``2026-11-25T15:04:05Z``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Principal(BaseModel):
    """Who a request is: the token that authenticated it (``GET /v1/whoami``)."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    role: Role
    team: str | None = None
    expires_at: float | None = None
    # The SHA-256 of the secret, as the store keeps it. Never shown.
    key: str = Field(exclude=True, repr=False)
    # The key of the token's dashboard sessions: its hash, HMAC'd with the bootstrap token
    # (see :meth:`Tokens.session_key`), so a reader of the store cannot forge a session.
    session_key: str = Field(default="", exclude=True, repr=False)

    def view(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class TokenRequest(BaseModel):
    """The body of ``POST /v1/tokens``."""

    model_config = ConfigDict(extra="forbid")

    role: Role
    team: str | None = Field(default=None, pattern=_TEAM, description="A member's team.")
    name: str | None = Field(default=None, pattern=_NAME, description="A label; default: id.")
    expires: float | None = Field(
        default=None, description="Seconds, or '30d', '12h'; default: never."
    )

    @field_validator("expires", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> float | None:
        if value is None:
            return None
        seconds = parse_duration(value)
        if seconds > MAX_EXPIRY_S:
            raise ValueError(f"at most {MAX_EXPIRY_S / 86400:.0f} days")
        return seconds

    @model_validator(mode="after")
    def _member_has_team(self) -> Self:
        if self.role is Role.MEMBER and self.team is None:
            raise ValueError("field 'team': a member token needs a team")
        return self


class TokenInfo(BaseModel):
    """A stored token as ``GET /v1/tokens`` shows it: never its secret or hash."""

    id: str
    name: str
    role: Role
    team: str | None
    created_at: float
    created_by: str
    expires_at: float | None
    revoked_at: float | None
    revoked_by: str | None
    state: str  # active, expired, revoked


def request_error(exc: ValidationError) -> str:
    """A :class:`TokenRequest` error in one line naming each field."""
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(message if message.startswith("field ") else f"field {field!r}: {message}")
    return "; ".join(parts)


class Tokens:
    """The tokens in ``store`` and the bootstrap token; ``clock``: seconds since the epoch."""

    def __init__(
        self, store: TokenRows | Store, bootstrap: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._rows = TokenRows(store) if isinstance(store, Store) else store
        self._clock = clock
        self._server_secret = bootstrap.encode()  # in api.token_file, never in the store
        key = digest(bootstrap)
        self.bootstrap = Principal(
            id=BOOTSTRAP_ID,
            name=BOOTSTRAP_ID,
            role=Role.ADMIN,
            key=key,
            session_key=self.session_key(key),
        )

    def session_key(self, key: str) -> str:
        """The dashboard-session key of the token whose stored hash is ``key``: keyed by
        the bootstrap token too, which lives in ``api.token_file`` and never in the store,
        so that reading ``state.db`` forges no session. Revoking a token ends its sessions;
        replacing the bootstrap token ends them all."""
        message = b"phalanx dashboard session key v2:" + key.encode()
        return hmac.new(self._server_secret, message, hashlib.sha256).hexdigest()

    def create(self, req: TokenRequest, by: Principal) -> tuple[TokenInfo, str]:
        """A new token and its secret (the only time the secret exists outside a client)."""
        now = self._clock()
        seq = self._rows.next_token_seq()
        token_id = f"t{seq}"
        secret = f"{PREFIX}_{token_id}_{secrets.token_urlsafe(SECRET_BYTES)}"
        expires_at = now + req.expires if req.expires is not None else None
        self._rows.add_token(
            seq,
            token_id,
            req.name or token_id,
            req.role.value,
            req.team,
            digest(secret),
            now,
            by.id,
            expires_at,
        )
        return self.info(token_id), secret

    def info(self, token_id: str) -> TokenInfo:
        row = self._rows.token_row(token_id) if _ID.match(token_id) else None
        if row is None:
            raise UnknownToken(token_id)
        return self._info(row)

    def list(self) -> list[TokenInfo]:
        return [self._info(r) for r in self._rows.token_rows()]

    def revoke(self, token_id: str, by: Principal) -> TokenInfo:
        if token_id == BOOTSTRAP_ID:
            raise Refused(
                "the bootstrap token is the one in api.token_file: to end it, put a new "
                "token in that file and restart the supervisor"
            )
        found = self.info(token_id)
        if found.revoked_at is not None:
            raise Refused(f"token {token_id} was revoked at {when(found.revoked_at)} already")
        self._rows.revoke_token(token_id, self._clock(), by.id)
        return self.info(token_id)

    def authenticate(self, secret: str) -> Principal:
        """The token whose secret is ``secret``; :class:`Unauthorized` naming why not."""
        key = digest(secret.strip())
        if hmac.compare_digest(key, self.bootstrap.key):
            return self.bootstrap
        prefix, _, rest = secret.strip().partition("_")
        token_id = rest.partition("_")[0]
        found = self.principal(token_id) if prefix == PREFIX and _ID.match(token_id) else None
        if found is None or not hmac.compare_digest(key, found.key):
            raise Unauthorized("wrong token")
        return found

    def principal(self, token_id: str) -> Principal | None:
        """The valid token ``token_id`` (None: unknown); :class:`Unauthorized` when it
        expired or was revoked."""
        if token_id == BOOTSTRAP_ID:
            return self.bootstrap
        row = self._rows.token_row(token_id) if _ID.match(token_id) else None
        if row is None:
            return None
        info = self._info(row)
        if info.revoked_at is not None:
            raise Unauthorized(f"token {token_id} was revoked at {when(info.revoked_at)}")
        if info.expires_at is not None and info.expires_at <= self._clock():
            raise Unauthorized(f"token {token_id} expired at {when(info.expires_at)}")
        return Principal(
            id=info.id,
            name=info.name,
            role=info.role,
            team=info.team,
            expires_at=info.expires_at,
            key=str(row[4]),
            session_key=self.session_key(str(row[4])),
        )

    def _info(self, row: tuple[Any, ...]) -> TokenInfo:
        token_id, name, role, team, _, created_at, created_by, expires, revoked, revoked_by = row
        state = "active"
        if revoked is not None:
            state = "revoked"
        elif expires is not None and expires <= self._clock():
            state = "expired"
        return TokenInfo(
            id=token_id,
            name=name,
            role=Role(role),
            team=team,
            created_at=created_at,
            created_by=created_by,
            expires_at=expires,
            revoked_at=revoked,
            revoked_by=revoked_by,
            state=state,
        )
