"""TLS of a client connection to the broker: the SSL context from `BrokerOptions`, and plain words for why
a handshake failed.

paho reports a failed handshake as OpenSSL's reason string, or not at all: a broker that demands a client
certificate completes the TLS 1.3 handshake and then closes the connection, which the client sees as an
end of file once it has sent its CONNECT. `probe` repeats the handshake and only listens, so the broker's
alert (certificate required) arrives before anything of ours could reset the connection; `explain` turns
either error into what to change.
"""

from __future__ import annotations

import socket
import ssl

from protofl.transport.broker_url import BrokerOptions

PROBE_TIMEOUT = 3.0
_CLIENT_CERT_REFUSED = (
    "ALERT_BAD_CERTIFICATE",
    "ALERT_UNKNOWN_CA",
    "ALERT_CERTIFICATE_UNKNOWN",
    "ALERT_DECRYPT_ERROR",
    "ALERT_CERTIFICATE_EXPIRED",
    "ALERT_UNSUPPORTED_CERTIFICATE",
)


def client_context(opts: BrokerOptions) -> ssl.SSLContext:
    """Verify the broker with the CA file, else the CA text (a credentials file's), else the system's
    trusted CAs; present the client certificate if there is one."""
    ctx = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=opts.tls_ca, cadata=None if opts.tls_ca else opts.tls_ca_pem
    )
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if opts.tls_cert:
        ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
    ctx.check_hostname = opts.tls_check_hostname  # the chain is verified either way (CERT_REQUIRED)
    return ctx


def probe(opts: BrokerOptions, timeout: float = PROBE_TIMEOUT) -> BaseException | None:
    """Handshake with the broker and wait for its first bytes without sending any. None: the broker
    accepted us and waits for our CONNECT (TLS is fine); else the error the handshake or the wait raised."""
    try:
        with socket.create_connection((opts.host, opts.port), timeout=timeout) as raw:
            with client_context(opts).wrap_socket(raw, server_hostname=opts.host) as tls:
                tls.settimeout(timeout)
                answered = tls.recv(1)
    except TimeoutError:
        return None
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError; CertificateError a ValueError
        return exc
    return None if answered else ConnectionError("the broker closed the connection after the TLS handshake")


def explain(exc: BaseException | None, opts: BrokerOptions) -> str | None:
    """What a TLS failure means and which flags fix it; None if `exc` is no TLS failure we know."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return _broker_not_verified(exc, opts)
    reason = str(getattr(exc, "reason", "") or "")
    if not isinstance(exc, ssl.SSLError) or not reason:
        return None
    if "CERTIFICATE_REQUIRED" in reason or (reason.endswith("ALERT_HANDSHAKE_FAILURE") and not opts.tls_cert):
        return (
            f"the broker at {opts.url} demanded a client certificate and refused the TLS handshake without "
            f"one: pass --tls-cert FILE --tls-key FILE (a certificate signed by the CA the broker requires, "
            f"its --client-ca)"
        )
    if reason.endswith(_CLIENT_CERT_REFUSED):
        return (
            f"the broker at {opts.url} refused this client's certificate (--tls-cert {opts.tls_cert}; "
            f"{reason}): it is not signed by the CA the broker requires, or it expired"
        )
    if "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER_FAILURE" in reason:
        return (
            f"{opts.host}:{opts.port} does not speak TLS: use the broker's TLS port, or mqtt:// without "
            f"TLS files if the broker has no TLS"
        )
    return None


def _broker_not_verified(exc: ssl.SSLCertVerificationError, opts: BrokerOptions) -> str:
    detail = str(exc.verify_message or exc.reason or exc)
    if "mismatch" in detail:
        return (
            f"the certificate of the broker at {opts.url} does not name '{opts.host}' ({detail}): connect by "
            f"a name or address the certificate holds (its subjectAltName)"
        )
    if "expired" in detail or "not yet valid" in detail:
        return f"the certificate of the broker at {opts.url} is not valid now ({detail}){_clock_hint(opts)}"
    return (
        f"the broker at {opts.url} presented a certificate that {opts.ca_description} did not sign "
        f"({detail}): it is not the broker that CA vouches for (another process may hold its port), or "
        f"the CA is the wrong one"
    )


def peer_certificate(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> bytes | None:
    """The TLS server's certificate (DER), not verified: only its dates are read."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, ctx.wrap_socket(raw) as tls:
            return tls.getpeercert(binary_form=True)
    except (OSError, ValueError):
        return None


def _clock_hint(opts: BrokerOptions) -> str:
    """A certificate that is not valid now: this device's clock against the certificate's validity (a device
    without RTC boots in 1970, or at its last shutdown's time, until NTP sets its clock)."""
    from datetime import datetime, timezone

    from cryptography import x509

    der = peer_certificate(opts.host, opts.port)
    if der is None:
        return ""
    cert = x509.load_der_x509_certificate(der)
    fmt = "%Y-%m-%d %H:%M UTC"
    return (
        f": this device's clock says {datetime.now(timezone.utc).strftime(fmt)}, the certificate is valid from "
        f"{cert.not_valid_before_utc.strftime(fmt)} to {cert.not_valid_after_utc.strftime(fmt)}; set the clock "
        f"(timedatectl set-ntp true, or date -s) and join again (protofl-edge doctor checks it)"
    )
