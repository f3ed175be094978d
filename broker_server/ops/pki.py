"""The federation's own certificate authority and its broker's certificate (TLS by default beyond loopback).

`protofl-server start` generates, once per federation, a CA (an EC P-256 key and a self-signed
certificate, valid 10 years) and a broker certificate it signs, in `security/tls/` (keys 0600). The CA
certificate travels in each device's credentials file; `protofl-edge join --credentials` then speaks TLS
and accepts only a broker whose certificate this CA signed. The CA signs nothing but the federation's brokers
(the core's, and site brokers': `ensure_site_tls`), so a certificate it signed is one of this federation's
brokers whatever address a device used: devices do not match host names (see
BrokerOptions.with_federation_ca). The broker certificate still names the listen host, this machine's
host name and loopback, for tools that do match names (mosquitto_sub --cafile).

Both are kept across restarts (devices keep their files); the broker certificate is signed again when it
nears its end, when the CA changed, or when it lacks a name asked for. A CA near its end is replaced, and
then every device needs its new credentials file.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from broker_server.ops.broker import ListenerTls
from broker_server.ops.security import write_secret

CA_DAYS = 3650
BROKER_DAYS = 825
RENEW_BEFORE = timedelta(days=30)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")

_Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class FederationTls:
    """Where the generated files are, and the broker listener that serves them."""

    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def broker_cert(self) -> Path:
        return self.directory / "broker.crt"

    @property
    def broker_key(self) -> Path:
        return self.directory / "broker.key"

    def ca_pem(self) -> str:
        return self.ca_cert.read_text()

    def listener(self, client_ca: str | None = None) -> ListenerTls:
        """The broker's TLS listener; with `client_ca`, every client must present a certificate it signed."""
        return ListenerTls(
            str(self.broker_cert),
            str(self.broker_key),
            client_ca or str(self.ca_cert),
            require_client_cert=client_ca is not None,
        )


def broker_names(listen_host: str) -> list[str]:
    """The names the broker certificate holds: the listen host (unless a wildcard), this machine's host
    name, and loopback."""
    names = [] if listen_host in WILDCARD_HOSTS else [listen_host]
    names += [socket.gethostname(), "localhost", "127.0.0.1", "::1"]
    return list(dict.fromkeys(n for n in names if n and n.isascii()))


def ensure_federation_tls(directory: Path, fed: str, names: Iterable[str]) -> FederationTls:
    """Load or generate the federation CA and a broker certificate for `names` in `directory`."""
    out = FederationTls(directory)
    ca = _ensure_ca(out, fed)
    _ensure_broker_cert(out, fed, list(names), ca)
    return out


def ensure_site_tls(core: FederationTls, directory: Path, fed: str, names: Iterable[str]) -> FederationTls:
    """A site broker's TLS files in `directory`: the federation CA's certificate (not its key) and a broker
    certificate for `names` signed by the CA in `core` (generated there if missing, as `start` would), so
    the devices' credentials files verify the site broker as they verify the core."""
    ca = _ensure_ca(core, fed)
    out = FederationTls(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    out.ca_cert.write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
    _ensure_broker_cert(out, fed, list(names), ca)
    return out


def certificate_names(path: Path) -> set[str]:
    """The DNS names and IP addresses a certificate holds (empty if it cannot be read)."""
    try:
        return _names(x509.load_pem_x509_certificate(path.read_bytes()))
    except (OSError, ValueError):
        return set()


def _ensure_ca(out: FederationTls, fed: str) -> tuple[x509.Certificate, _Key]:
    out.directory.mkdir(parents=True, exist_ok=True)
    os.chmod(out.directory, 0o700)
    ca = _load(out.ca_cert, out.ca_key)
    if ca is None:
        ca = _self_signed_ca(fed)
        _save(ca, out.ca_cert, out.ca_key)
    return ca


def _ensure_broker_cert(out: FederationTls, fed: str, wanted: list[str], ca: tuple[x509.Certificate, _Key]) -> None:
    current = _load(out.broker_cert, out.broker_key)
    if current is None or not _signed_by(current[0], ca[0]):
        _save(_broker_certificate(fed, wanted, ca), out.broker_cert, out.broker_key)
    elif not set(wanted) <= _names(current[0]):
        # Names it held stay (a site's bridge dials the core by one of them: broker-config --bridge added it).
        held = [n for n in sorted(_names(current[0])) if n not in wanted]
        _save(_broker_certificate(fed, [*wanted, *held], ca), out.broker_cert, out.broker_key)


def _load(cert_path: Path, key_path: Path) -> tuple[x509.Certificate, _Key] | None:
    """A certificate and its key, if both exist and the certificate is valid beyond RENEW_BEFORE."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or cert.not_valid_after_utc - RENEW_BEFORE < _now():
        return None
    return cert, key


def _save(pair: tuple[x509.Certificate, _Key], cert_path: Path, key_path: Path) -> None:
    cert, key = pair
    write_secret(
        key_path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode(),
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(n) for n in san.get_values_for_type(x509.DNSName)} | {
        str(n) for n in san.get_values_for_type(x509.IPAddress)
    }


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _builder(subject: str, issuer: x509.Name, key: _Key, days: int) -> x509.CertificateBuilder:
    now = _now()
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))  # a device whose clock is a little behind
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def _self_signed_ca(fed: str) -> tuple[x509.Certificate, _Key]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = f"protofl federation {fed} CA"[:64]  # a common name holds at most 64 characters
    usage = x509.KeyUsage(
        digital_signature=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        _builder(subject, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]), key, CA_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _broker_certificate(fed: str, names: list[str], ca: tuple[x509.Certificate, _Key]) -> tuple[x509.Certificate, _Key]:
    ca_cert, ca_key = ca
    key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        _builder(f"protofl federation {fed} broker"[:64], ca_cert.subject, key, BROKER_DAYS)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)
