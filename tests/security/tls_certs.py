"""Certificates made at test time (cryptography): a CA, server and client certificates, and
a second, untrusted CA with a client certificate of its own.

``make_pki(dir)`` writes PEM files and returns their paths. Server certificates name
127.0.0.1 and localhost (what the tests dial); EC P-256 keys keep generation fast.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertPair:
    cert: str
    key: str


@dataclass(frozen=True)
class Pki:
    ca: str  # the deployment's CA
    server: CertPair  # signed by ca, for 127.0.0.1 / localhost
    client: CertPair  # signed by ca (a router, a CLI)
    rogue_ca: str  # another CA nobody trusts
    rogue_client: CertPair  # signed by rogue_ca
    rogue_server: CertPair  # signed by rogue_ca, for 127.0.0.1


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> str:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(path)


def _write_cert(cert: x509.Certificate, path: Path) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _make_ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _issue(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    cn: str,
    *,
    server: bool,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return builder.sign(ca_key, hashes.SHA256()), key


def _pair(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    cn: str,
    out: Path,
    *,
    server: bool,
) -> CertPair:
    cert, key = _issue(ca, ca_key, cn, server=server)
    return CertPair(_write_cert(cert, out / f"{cn}.pem"), _write_key(key, out / f"{cn}.key"))


def make_pki(out: Path) -> Pki:
    """A fresh PKI under ``out``."""
    ca, ca_key = _make_ca("kvroute-test-ca")
    rogue, rogue_key = _make_ca("rogue-ca")
    return Pki(
        ca=_write_cert(ca, out / "ca.pem"),
        server=_pair(ca, ca_key, "server", out, server=True),
        client=_pair(ca, ca_key, "client", out, server=False),
        rogue_ca=_write_cert(rogue, out / "rogue-ca.pem"),
        rogue_client=_pair(rogue, rogue_key, "rogue-client", out, server=False),
        rogue_server=_pair(rogue, rogue_key, "rogue-server", out, server=True),
    )
