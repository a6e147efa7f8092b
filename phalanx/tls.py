"""TLS for the daemons' HTTP: what a server presents and what a client trusts.

A server serves HTTPS with a PEM certificate (chain) and its key; a client verifies
the server against a CA bundle (the system's store when none is named), hostname or
IP address included: never without verification. The checks here read and load the
files once, at configuration time, so that a bad file is an error naming it before
anything listens.
"""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = [
    "check_ca_file",
    "check_readable",
    "check_server_pair",
    "client_context",
    "server_context",
]


def check_readable(path: Path) -> Path:
    """``path`` when it is a readable file; a ``ValueError`` naming it otherwise."""
    try:
        with path.open("rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return path


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """The context a server presents ``cert_file`` with (TLS 1.2 at least)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert_file), str(key_file))
    return ctx


def client_context(ca_file: Path | None) -> ssl.SSLContext:
    """A context that verifies the server's certificate and name against ``ca_file`` (the
    system's CA store when ``None``)."""
    ctx = ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def check_server_pair(cert_file: Path, key_file: Path) -> None:
    """A ``ValueError`` naming the file when ``cert_file`` and ``key_file`` are not a PEM
    certificate and its private key."""
    try:
        server_context(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ValueError(
            f"{cert_file} and {key_file} are not a PEM certificate and its private key "
            f"({exc.reason or exc})"
        ) from exc
    except OSError as exc:
        raise ValueError(f"cannot load {cert_file} / {key_file}: {exc}") from exc


def check_ca_file(ca_file: Path) -> Path:
    """``ca_file`` when it is a readable PEM bundle of CA certificates; a ``ValueError``
    naming it otherwise."""
    check_readable(ca_file)
    try:
        ctx = client_context(ca_file)  # an empty file fails too: no certificate found
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"{ca_file} is not a PEM bundle of CA certificates ({exc})") from exc
    del ctx
    return ca_file
