"""TLS and mutual TLS for every hop: client -> router, router -> worker, worker -> Redis.

Certificates come from PEM files named by flags; this module reads them once at start-up
(an unreadable or non-PEM file is a :class:`TlsConfigError` naming the flag and the path, so
a process refuses to start instead of failing at the first call) and turns them into what
each library wants::

    ServerTls(cert, key, client_ca)   gRPC server credentials (mTLS when client_ca is given)
                                      and an ssl.SSLContext for the aiohttp HTTP fronts
    ClientTls(ca, cert, key)          gRPC channel credentials (a client certificate when
                                      cert/key are given), an ssl.SSLContext for HTTP
                                      clients, and redis-py's ssl_* keywords (rediss://)

``None`` everywhere means plaintext, as before: :func:`add_port` and :func:`channel` keep the
insecure calls in one place.

Identity: a server's certificate must name the address clients dial (a subjectAltName DNS or
IP entry); ``ClientTls.server_name`` overrides the name checked (e.g. one certificate for
every worker pod, dialled by pod IP). With ``--tls-client-ca`` a server accepts only clients
whose certificate that CA signed: that is how workers accept calls only from routers.
"""

from __future__ import annotations

import errno
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc


class TlsConfigError(ValueError):
    """A TLS option is missing its partner, or a file cannot be read; names the flag."""


def read_pem(path: str, flag: str) -> bytes:
    """The bytes of the PEM file ``path`` given with ``flag`` (TlsConfigError otherwise)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsConfigError(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise TlsConfigError(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A server's certificate and key; with ``client_ca`` clients must present a
    certificate that CA signed (mutual TLS). ``flag`` names the options in errors."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    flag: str = "--tls"

    def __post_init__(self) -> None:
        # read everything now: a bad path fails the start, naming the flag
        self.cert_pem()
        self.key_pem()
        if self.client_ca_file is not None:
            self.client_ca_pem()

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def cert_pem(self) -> bytes:
        return read_pem(self.cert_file, f"{self.flag}-cert")

    def key_pem(self) -> bytes:
        return read_pem(self.key_file, f"{self.flag}-key")

    def client_ca_pem(self) -> bytes | None:
        if self.client_ca_file is None:
            return None
        return read_pem(self.client_ca_file, f"{self.flag}-client-ca")

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key_pem(), self.cert_pem())],
            root_certificates=self.client_ca_pem(),
            require_client_auth=self.mutual,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """A server-side context for aiohttp (TLS 1.2+; client certificates required with
        a client CA)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
            if self.client_ca_file is not None:
                ctx.load_verify_locations(cafile=self.client_ca_file)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except ssl.SSLError as exc:
            raise TlsConfigError(
                f"{self.flag}-cert/{self.flag}-key: {self.cert_file}, {self.key_file}: {exc}"
            ) from None
        return ctx


@dataclass(frozen=True, slots=True)
class ClientTls:
    """What a client trusts (``ca_file``; None: the system's roots) and, for mutual TLS,
    the certificate it presents. ``server_name`` overrides the name checked in the
    server's certificate. ``flag`` names the options in errors (e.g. ``--worker-tls``)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None
    flag: str = "--tls"

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise TlsConfigError(f"{self.flag}-cert and {self.flag}-key must be given together")
        self.ca_pem()
        if self.cert_file is not None:
            self.cert_pem()
            self.key_pem()

    def ca_pem(self) -> bytes | None:
        return None if self.ca_file is None else read_pem(self.ca_file, f"{self.flag}-ca")

    def cert_pem(self) -> bytes | None:
        return None if self.cert_file is None else read_pem(self.cert_file, f"{self.flag}-cert")

    def key_pem(self) -> bytes | None:
        return None if self.key_file is None else read_pem(self.key_file, f"{self.flag}-key")

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem(),
            private_key=self.key_pem(),
            certificate_chain=self.cert_pem(),
        )

    def grpc_options(self) -> list[tuple[str, str]]:
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]

    def ssl_context(self) -> ssl.SSLContext:
        """A client-side context (HTTP clients, tests)."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca_file)
        if self.cert_file is not None and self.key_file is not None:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def redis_kwargs(self) -> dict[str, Any]:
        """redis-py's keywords for a rediss:// URL."""
        kwargs: dict[str, Any] = {"ssl_cert_reqs": "required"}
        if self.ca_file is not None:
            kwargs["ssl_ca_certs"] = self.ca_file
        if self.cert_file is not None:
            kwargs["ssl_certfile"] = self.cert_file
            kwargs["ssl_keyfile"] = self.key_file
        if self.server_name is None:
            kwargs["ssl_check_hostname"] = True
        return kwargs


def server_tls_from_flags(
    cert: str | None, key: str | None, client_ca: str | None, *, flag: str = "--tls"
) -> ServerTls | None:
    """The ServerTls the ``{flag}-cert/-key/-client-ca`` options describe (None: plaintext)."""
    if cert is None and key is None:
        if client_ca is not None:
            raise TlsConfigError(f"{flag}-client-ca needs {flag}-cert and {flag}-key")
        return None
    if cert is None or key is None:
        raise TlsConfigError(f"{flag}-cert and {flag}-key must be given together")
    return ServerTls(cert, key, client_ca, flag=flag)


def client_tls_from_flags(
    ca: str | None,
    cert: str | None,
    key: str | None,
    *,
    server_name: str | None = None,
    flag: str = "--tls",
) -> ClientTls | None:
    """The ClientTls the ``{flag}-ca/-cert/-key`` options describe (None: plaintext)."""
    if ca is None and cert is None and key is None:
        if server_name is not None:
            raise TlsConfigError(f"{flag}-server-name needs {flag}-ca (or a client cert)")
        return None
    return ClientTls(ca, cert, key, server_name, flag=flag)


def add_port(server: grpc.aio.Server, address: str, tls: ServerTls | None) -> int:
    """Bind ``address`` with TLS when given, plaintext otherwise; the bound port. OSError
    saying why when it cannot be bound (grpc itself says only "Failed to bind")."""
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.grpc_credentials())
    except RuntimeError:  # in use, no such address, no rights
        port = 0
    if port == 0:
        raise OSError(f"could not bind {address}: {_bind_failure(address)}")
    return port


def _bind_failure(address: str) -> str:
    """Why ``host:port`` cannot be bound, found by binding a plain socket to it."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port_text), type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(sockaddr)
    except (OSError, ValueError) as exc:
        return bind_error_reason(exc)
    return "grpc refused the address"


def bind_error_reason(exc: OSError | ValueError) -> str:
    """Why a bind failed, in one line; a taken port asks whether another server holds it."""
    reason = getattr(exc, "strerror", None) or str(exc)
    if getattr(exc, "errno", None) == errno.EADDRINUSE:
        return f"{reason} (is another kvroute or server listening there?)"
    return reason


def channel(
    address: str,
    tls: ClientTls | None,
    *,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address``: TLS when given, plaintext otherwise."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(
        address,
        tls.grpc_credentials(),
        options=[*options, *tls.grpc_options()],
        interceptors=interceptors,
    )


@dataclass(frozen=True, slots=True)
class RedisAuth:
    """How a process reaches Redis beyond its URL: TLS (rediss://) and an ACL user."""

    tls: ClientTls | None = None
    username: str | None = None
    password: str | None = None

    def check_url(self, url: str) -> None:
        if self.tls is not None and not url.startswith("rediss://"):
            raise TlsConfigError(
                f"--redis-tls-* options need a rediss:// URL, got {url.split('://')[0]}://"
            )

    def client_kwargs(self) -> dict[str, Any]:
        """Keywords for ``redis.asyncio.Redis.from_url`` (the URL's own user wins if set)."""
        kwargs: dict[str, Any] = {} if self.tls is None else self.tls.redis_kwargs()
        if self.username is not None:
            kwargs["username"] = self.username
        if self.password is not None:
            kwargs["password"] = self.password
        return kwargs
