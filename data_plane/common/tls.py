"""TLS on every listener and every hop, configured once for all processes by environment.

    SWITCHBOARD_TLS_CERT=cert.pem SWITCHBOARD_TLS_KEY=key.pem SSL_CERT_FILE=ca.pem switchboard gateway ...
    switchboard gateway --tls-cert cert.pem --tls-key key.pem --ca-bundle ca.pem ...   # the same, as flags
    switchboard up --tls                     # makes a local CA and a certificate, sets all three

    tls = TlsConfig.from_env()
    uvicorn.run(app, host=h, port=p, **tls.uvicorn_kwargs())   # listens with TLS when a cert is set
    url = f"{tls.scheme}://{host}:{port}"                      # what the process registers

Clients verify peers against the CA bundle named by the standard ``SSL_CERT_FILE`` (httpx honours it,
and so does every `ssl.create_default_context()`, which the hop client uses for ``https://`` members);
a peer whose certificate that CA did not sign, or a plain-HTTP peer, is refused. `make_dev_pki` is
what `switchboard up --tls` uses: a CA and one server certificate for 127.0.0.1 / localhost / the
host name, valid 90 days, keys mode 600.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TLS_CERT_ENV = "SWITCHBOARD_TLS_CERT"
"""PEM certificate (chain) every listener of this process presents."""
TLS_KEY_ENV = "SWITCHBOARD_TLS_KEY"
"""Its PEM private key."""
CA_BUNDLE_ENV = "SSL_CERT_FILE"
"""The CA bundle clients verify peers with (the standard OpenSSL / httpx variable)."""


TLS_FLAGS = {"--tls-cert": TLS_CERT_ENV, "--tls-key": TLS_KEY_ENV, "--ca-bundle": CA_BUNDLE_ENV}
"""Flags every `switchboard` subcommand accepts (taken off its argv by `take_tls_flags`)."""
TLS_FLAG_HELP = {
    "--tls-cert": "PEM certificate (chain) this process's listeners present; with --tls-key they serve HTTPS, "
                  "and the URL it registers is https://",
    "--tls-key": "the PEM private key of --tls-cert",
    "--ca-bundle": "PEM CA bundle that peers' certificates are verified with (members, the control plane)",
}
"""The flags' help text (`add_tls_flags`)."""


def is_loopback(host: str) -> bool:
    """Whether a listener on `host` (an address or a name) is reachable from this machine only: every
    address the name resolves to is loopback. A name that does not resolve counts as reachable."""
    name = host.strip("[]")
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(name, None)}
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def take_tls_flags(argv: list[str]) -> list[str]:
    """Remove the TLS flags from `argv` (``--tls-cert P`` or ``--tls-cert=P``), put them in the
    environment (where every process reads them and its children inherit them); the rest is returned."""
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in TLS_FLAGS:
            _set_tls_file(name, value if eq else next(args, ""))
        else:
            rest.append(arg)
    return rest


def _set_tls_file(flag: str, value: str) -> None:
    if not value:
        raise SystemExit(f"{flag} needs a file")
    if not Path(value).is_file():
        raise SystemExit(f"{flag}: no such file {value!r}")
    os.environ[TLS_FLAGS[flag]] = str(Path(value).resolve())


class _TlsFile(argparse.Action):
    """A TLS flag met by a subcommand's own parser (`switchboard` takes them off argv before, so this runs
    only when the module is called directly): the same effect, the environment, and nothing in the result."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        _set_tls_file(str(option_string), str(values))


def add_tls_flags(parser: argparse.ArgumentParser, flags: tuple[str, ...] = tuple(TLS_FLAGS)) -> None:
    """List the TLS flags in `parser`'s --help (their own group, with their environment variables), and
    accept them there too; they never appear in the parsed namespace (default SUPPRESS)."""
    group = parser.add_argument_group("TLS", "Accepted by every `switchboard` command and inherited by the processes "
                                      "it starts; the same as the environment variables named.")
    for flag in flags:
        group.add_argument(flag, metavar="FILE", action=_TlsFile, default=argparse.SUPPRESS,
                           help=f"{TLS_FLAG_HELP[flag]} [env {TLS_FLAGS[flag]}]")


@dataclass(frozen=True)
class TlsConfig:
    cert: str | None = None
    key: str | None = None

    @classmethod
    def from_env(cls) -> TlsConfig:
        cert, key = os.environ.get(TLS_CERT_ENV) or None, os.environ.get(TLS_KEY_ENV) or None
        if bool(cert) != bool(key):
            raise SystemExit(f"TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}")
        return cls(cert, key)

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    @property
    def scheme(self) -> str:
        return "https" if self.enabled else "http"

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """``ssl_certfile`` / ``ssl_keyfile`` for uvicorn.run or uvicorn.Config ({} without TLS)."""
        return {"ssl_certfile": self.cert, "ssl_keyfile": self.key} if self.cert and self.key else {}


@dataclass(frozen=True)
class DevPki:
    ca: Path
    cert: Path
    key: Path

    def env(self) -> dict[str, str]:
        """What every process of the platform needs to listen and to verify its peers."""
        return {TLS_CERT_ENV: str(self.cert), TLS_KEY_ENV: str(self.key), CA_BUNDLE_ENV: str(self.ca)}


def make_dev_pki(folder: Path, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> DevPki:
    """A local CA and a server certificate it signed for `hosts` (and this host's name), made once:
    an existing set in `folder` is reused."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    pki = DevPki(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    if pki.ca.exists() and pki.cert.exists() and pki.key.exists():
        return pki
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Switchboard local CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=90))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for host in (*hosts, socket.gethostname()):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "switchboard")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=90))
            .add_extension(x509.SubjectAlternativeName(list(dict.fromkeys(names))), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(pki.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return pki
