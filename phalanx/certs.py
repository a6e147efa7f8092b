"""A throw-away certificate authority, for local fleets, tests and benchmarks.

``phalanx local up --tls`` makes one under the fleet's folder; the integration
harness and ``bench/peer_tls.py`` use the same helper. Keys are ECDSA P-256 and
certificates are valid for a few days: nothing here is meant for a real fleet,
whose operator brings certificates from their own CA (docs/operations.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Authority", "Issued", "make_authority"]

VALID = datetime.timedelta(days=7)


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


class Authority:
    """A CA whose certificate is ``ca`` (PEM); :meth:`issue` signs server certificates."""

    def __init__(self, directory: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate):
        self.directory = directory
        self._key = key
        self._cert = cert
        self.ca = directory / "ca.pem"

    def issue(
        self,
        name: str,
        *,
        ips: tuple[str, ...] = ("127.0.0.1",),
        dns: tuple[str, ...] = ("localhost",),
    ) -> Issued:
        """A server certificate ``NAME.pem`` / ``NAME.key`` valid for ``ips`` and ``dns``
        (subject alternative names: clients verify the address they dial against them)."""
        now = datetime.datetime.now(datetime.UTC)
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        sans += [x509.DNSName(d) for d in dns]
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + VALID)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        issued = Issued(self.directory / f"{name}.pem", self.directory / f"{name}.key")
        _write_key(issued.key, key)
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return issued


def make_authority(directory: Path, name: str = "") -> Authority:
    """A new CA under ``directory``: ``ca.pem`` (share it with clients) and ``ca.key``
    (mode 0600). Its name (default: ``phalanx throw-away CA`` and a random tag) tells it
    from another fleet's."""
    name = name or f"phalanx throw-away CA {secrets.token_hex(4)}"
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    authority = Authority(directory, key, cert)
    _write_key(directory / "ca.key", key)
    authority.ca.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return authority


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """The key as PKCS#8 PEM, created with mode 0600 (never readable by others, even briefly)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
