"""A small synchronous client of the supervisor's REST API, for the CLI and tests.

An ``https://`` API is verified against ``ca_file`` (the CLI's ``PHALANX_CA`` or
``--ca``), or the system's CA store when none is given; never without verification.
"""

from __future__ import annotations

import http.client
import json
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
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.ca_file = ca_file
        self._tls: ssl.SSLContext | None = None
        if self.base_url.startswith("https://"):
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
        req = urllib.request.Request(
            f"{self.base_url}{path}", headers={"Authorization": f"Bearer {self.token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self._tls) as resp:
                return resp.read(), int(resp.headers.get("X-Phalanx-Offset", "0"))
        except urllib.error.HTTPError as exc:
            raise self._http_error(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            raise self._unreachable(exc) from None

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._call("POST", path, body or {})[0]

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> tuple[Any, Message]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"{self.base_url}{path}",
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self._tls) as resp:
                return json.loads(resp.read() or b"null"), resp.headers
        except urllib.error.HTTPError as exc:
            raise self._http_error(exc) from None
        except (urllib.error.URLError, OSError) as exc:
            raise self._unreachable(exc) from None

    @staticmethod
    def _http_error(exc: urllib.error.HTTPError) -> ApiError:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except (ValueError, AttributeError):
            message = str(exc.reason)
        return ApiError(exc.code, str(message))

    def _unreachable(self, exc: OSError) -> ApiError:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLCertVerificationError):
            trust = f"the CA in {self.ca_file}" if self.ca_file else "the system's CA store"
            return ApiError(
                0,
                f"the supervisor at {self.base_url} presented a certificate that {trust} "
                f"does not accept ({reason.verify_message}); point PHALANX_CA (or --ca) at "
                "the CA that signed the supervisor's certificate",
            )
        if isinstance(reason, ssl.SSLError):
            return ApiError(
                0,
                f"no TLS connection to the supervisor at {self.base_url} "
                f"({reason.reason or reason}): does it serve HTTPS (api.tls_cert_file)?",
            )
        if isinstance(reason, http.client.RemoteDisconnected) and self._tls is None:
            return ApiError(
                0,
                f"the supervisor at {self.base_url} closed the connection without an answer: "
                "if it serves HTTPS (api.tls_cert_file), use an https:// URL",
            )
        return ApiError(
            0,
            f"cannot reach the supervisor at {self.base_url}: {reason} "
            f"(timeout {self.timeout:.0f}s)",
        )
