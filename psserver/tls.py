"""TLS and mutual TLS for every task and client.

Give a task a certificate and key (``--tls-cert``/``--tls-key``, or
``$PSTRAIN_TLS_CERT``/``$PSTRAIN_TLS_KEY``, paths to PEM files) and it
serves TLS only. Give it a CA too (``--tls-ca`` / ``$PSTRAIN_TLS_CA``) and it
also demands a client certificate signed by that CA (mutual TLS). Clients
use the same three settings: the CA to trust the servers, and their own
certificate and key when the servers ask for one. A cluster may use one
certificate for every task, as LocalCluster does.
"""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import pathlib
import ssl
import tempfile

import grpc

CERT_ENV, KEY_ENV, CA_ENV = "PSTRAIN_TLS_CERT", "PSTRAIN_TLS_KEY", "PSTRAIN_TLS_CA"


@dataclasses.dataclass(frozen=True)
class TLSConfig:
    """PEM bytes; ``paths`` keeps where they came from, to hand to child tasks."""
    cert: bytes | None = None
    key: bytes | None = dataclasses.field(default=None, repr=False)   # never in a log line
    ca: bytes | None = None
    paths: tuple[str | None, str | None, str | None] = (None, None, None)

    @classmethod
    def from_files(cls, cert: str | None, key: str | None, ca: str | None) -> "TLSConfig | None":
        """None when no file is given. Raises ValueError for half a key pair."""
        if not (cert or key or ca):
            return None
        if bool(cert) != bool(key):
            raise ValueError("give both a TLS certificate and its key (or neither)")

        def read(p):
            try:
                return pathlib.Path(p).read_bytes() if p else None
            except OSError as exc:
                raise ValueError(f"cannot read TLS file {p}: {exc}") from None
        return cls(read(cert), read(key), read(ca), (cert, key, ca))

    @classmethod
    def from_env(cls, environ=os.environ) -> "TLSConfig | None":
        return cls.from_files(environ.get(CERT_ENV) or None, environ.get(KEY_ENV) or None,
                              environ.get(CA_ENV) or None)

    def env(self) -> dict[str, str]:
        """Environment variables that give a child task this configuration."""
        return {k: v for k, v in zip((CERT_ENV, KEY_ENV, CA_ENV), self.paths) if v}

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise ValueError("a TLS server needs a certificate and a key")
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    # The data ports (psserver/ipc.py over TCP) speak TLS through Python's ssl
    # module, with the same files and the same rules as gRPC: a server with a
    # CA demands client certificates; a client checks the server's name.
    def ssl_server_context(self) -> ssl.SSLContext:
        if not (self.cert and self.key):
            raise ValueError("a TLS server needs a certificate and a key")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load_chain(ctx)
        if self.ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cadata=self.ca.decode())
        return ctx

    def ssl_client_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # checks the certificate and name
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca is not None:
            ctx.load_verify_locations(cadata=self.ca.decode())
        else:
            ctx.load_default_certs()
        if self.cert and self.key:
            self._load_chain(ctx)
        return ctx

    def _load_chain(self, ctx: ssl.SSLContext) -> None:
        """ssl reads a key pair from files only: the given ones, else private
        temporary copies removed at once."""
        cert_path, key_path, _ = self.paths
        if cert_path and key_path:
            ctx.load_cert_chain(cert_path, key_path)
            return
        with tempfile.TemporaryDirectory(prefix="pstrain-tls-") as d:
            cert, key = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
            for path, data in ((cert, self.cert), (key, self.key)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            ctx.load_cert_chain(cert, key)


def client_config(tls: "TLSConfig | bool | None", environ=os.environ) -> "TLSConfig | None":
    """What a client connects with (None: plaintext), from its ``tls``
    argument: a TLSConfig is used as it is; None takes ``$PSTRAIN_TLS_CERT``,
    ``$PSTRAIN_TLS_KEY`` and ``$PSTRAIN_TLS_CA`` as the tasks do (plaintext
    when none is set); False is plaintext whatever they say. Raises
    ValueError naming the variables when they cannot be used."""
    if tls is False:
        return None
    if tls is None:
        try:
            return TLSConfig.from_env(environ)
        except ValueError as exc:
            raise ValueError(f"bad TLS settings in ${CERT_ENV} / ${KEY_ENV} / ${CA_ENV}: {exc}; "
                             "fix or unset them, or pass tls= (a TLSConfig, or False for "
                             "plaintext)") from None
    if not isinstance(tls, TLSConfig):
        raise TypeError(f"tls must be a psserver.tls.TLSConfig (TLSConfig.from_files(cert, key, "
                        f"ca)), None (from ${CERT_ENV} / ${KEY_ENV} / ${CA_ENV}) or False "
                        f"(plaintext), got {tls!r}")
    return tls


def make_channel(address: str, options: list, tls: TLSConfig | None) -> grpc.Channel:
    """A channel to address: TLS when tls is given, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def add_port(server: grpc.Server, address: str, tls: TLSConfig | None) -> int:
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def generate_self_signed(directory: str, hosts=("127.0.0.1", "localhost", "::1"),
                         days: int = 7) -> TLSConfig:
    """A throwaway CA and one certificate for ``hosts``, written to directory.

    The certificate serves as server and client identity of every task, and
    the CA is the only one trusted: mutual TLS with no set-up (LocalCluster).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pstrain local CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pstrain task")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    pem = serialization.Encoding.PEM
    files = {"ca.crt": ca_cert.public_bytes(pem), "tls.crt": cert.public_bytes(pem),
             "tls.key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())}
    for name, data in files.items():
        p = d / name
        p.write_bytes(data)
        os.chmod(p, 0o600)
    return TLSConfig.from_files(str(d / "tls.crt"), str(d / "tls.key"), str(d / "ca.crt"))


def add_arguments(parser) -> None:
    """--tls-cert/--tls-key/--tls-ca for a task's command line (env as defaults)."""
    parser.add_argument("--tls-cert", default=os.environ.get(CERT_ENV) or None,
                        help=f"PEM certificate: serve TLS only (default ${CERT_ENV})")
    parser.add_argument("--tls-key", default=os.environ.get(KEY_ENV) or None,
                        help=f"PEM private key of --tls-cert (default ${KEY_ENV})")
    parser.add_argument("--tls-ca", default=os.environ.get(CA_ENV) or None,
                        help=f"PEM CA: require client certificates it signed (mutual TLS), "
                             f"and trust servers it signed (default ${CA_ENV})")


def from_arguments(args) -> "TLSConfig | None":
    return TLSConfig.from_files(args.tls_cert, args.tls_key, args.tls_ca)
