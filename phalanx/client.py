"""A small synchronous client of the supervisor's REST API, for the CLI and tests.

An ``https://`` API is verified against ``ca_file`` (the CLI's ``PHALANX_CA`` or
``--ca``), or the system's CA store when none is given; never without verification.

``base_url`` may list several supervisors, comma-separated (a leader and its standbys,
``supervisor.leadership``): a request goes to the one that answered last; one that
cannot be connected to is passed over for the next, and a standby's 503 names the
leader (header ``X-Phalanx-Leader``), which is asked instead. A request is sent again
only where the first could not have been acted on: the connection was refused, or a
standby answered it.
"""

from __future__ import annotations

import errno
import http.client
import json
import socket
import ssl
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path
from typing import Any

from phalanx.tls import client_context


class ApiError(RuntimeError):
    """The supervisor answered with an error (``status`` > 0) or could not be reached (0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Client:
    def __init__(
        self, base_url: str, token: str, *, timeout: float = 10.0, ca_file: Path | None = None
    ) -> None:
        self.urls = [u.strip().rstrip("/") for u in base_url.split(",") if u.strip()]
        if not self.urls:
            raise ApiError(0, f"no supervisor URL in {base_url!r}")
        self.base_url = self.urls[0]  # the one asked first: the one that answered last
        self.token = token
        self.timeout = timeout
        self.ca_file = ca_file
        self._tls: ssl.SSLContext | None = None
        if any(u.startswith("https://") for u in self.urls):
            try:
                self._tls = client_context(ca_file)
            except (ssl.SSLError, OSError) as exc:
                raise ApiError(
                    0, f"cannot use {ca_file} as the CA of the supervisor's certificate: {exc}"
                ) from None

    def get(self, path: str) -> Any:
        return self._call("GET", path, None)[0]

    def get_page(self, path: str) -> tuple[Any, str | None]:
        """A page of a paged list (``GET /v1/jobs?limit=N``) and the next page's cursor
        (``X-Phalanx-Next``; None: the last page)."""
        body, headers = self._call("GET", path, None)
        return body, headers.get("X-Phalanx-Next")

    def get_bytes(self, path: str) -> tuple[bytes, int]:
        """Raw bytes and the ``X-Phalanx-Offset`` header (for logs)."""
        raw, headers = self._send("GET", path, None)
        return raw, int(headers.get("X-Phalanx-Offset", "0"))

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._call("POST", path, body or {})[0]

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[Any, Message]:
        data = json.dumps(body).encode() if body is not None else None
        raw, headers = self._send(method, path, data)
        return json.loads(raw or b"null"), headers

    def _send(self, method: str, path: str, data: bytes | None) -> tuple[bytes, Message]:
        """One request, to the leader among ``urls`` (see the module's doc)."""
        tried: list[str] = []
        error: ApiError | None = None
        url = self.base_url
        while True:
            tried.append(url)
            req = urllib.request.Request(
                f"{url}{path}",
                data=data,
                method=method,
                headers={
                    "Authorization": f"Bearer {self.token}",
                    "Content-Type": "application/json",
                },
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout, context=self._tls) as resp:
                    self.base_url = url
                    return resp.read(), resp.headers
            except urllib.error.HTTPError as exc:
                leader = (exc.headers.get("X-Phalanx-Leader") or "").rstrip("/")
                standby = exc.code == 503 and exc.headers.get("X-Phalanx-Standby") == "1"
                if not standby:  # the leader's own answer, whatever it is, is the answer
                    raise self._http_error(exc) from None
                error = error or self._http_error(exc)
                if leader and leader not in self.urls:
                    self.urls.append(leader)
                following = leader if leader and leader not in tried else None
            except (urllib.error.URLError, OSError) as exc:
                failed = self._unreachable(exc, url)
                if not _not_sent(exc):
                    raise failed from None
                error = error or failed
                following = None
            url = following or next((u for u in self.urls if u not in tried), "")
            if not url:
                if len(tried) > 1:
                    raise ApiError(error.status, f"{error} (tried {', '.join(tried)})") from None
                raise error from None

    @staticmethod
    def _http_error(exc: urllib.error.HTTPError) -> ApiError:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except (ValueError, AttributeError):
            message = str(exc.reason)
        return ApiError(exc.code, str(message))

    def _unreachable(self, exc: OSError, url: str | None = None) -> ApiError:
        base = url or self.base_url
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLCertVerificationError):
            trust = f"the CA in {self.ca_file}" if self.ca_file else "the system's CA store"
            return ApiError(
                0,
                f"the supervisor at {base} presented a certificate that {trust} "
                f"does not accept ({reason.verify_message}); point PHALANX_CA (or --ca) at "
                "the CA that signed the supervisor's certificate",
            )
        if isinstance(reason, ssl.SSLError):
            return ApiError(
                0,
                f"no TLS connection to the supervisor at {base} "
                f"({reason.reason or reason}): does it serve HTTPS (api.tls_cert_file)?",
            )
        if isinstance(reason, http.client.RemoteDisconnected) and self._tls is None:
            return ApiError(
                0,
                f"the supervisor at {base} closed the connection without an answer: "
                "if it serves HTTPS (api.tls_cert_file), use an https:// URL",
            )
        return ApiError(
            0,
            f"cannot reach the supervisor at {base}: {reason} (timeout {self.timeout:.0f}s)",
        )


def _not_sent(exc: OSError) -> bool:
    """Whether a failed request cannot have reached the supervisor: no connection was
    made (refused, no route, the name unknown, the connect timed out: urllib wraps
    only a connect's failure in a ``URLError``), so another may be asked safely."""
    if not isinstance(exc, urllib.error.URLError):
        return isinstance(exc, ConnectionRefusedError)
    reason = exc.reason
    return isinstance(reason, ConnectionRefusedError | socket.gaierror | TimeoutError) or (
        isinstance(reason, OSError)
        and reason.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ECONNREFUSED)
    )
