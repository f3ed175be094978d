"""TLS against a real Mosquitto, with certificates this test generates (openssl): server CA, client certs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509

from broker_server.ops.broker import ListenerTls, MosquittoBroker, free_port
from broker_server.ops.pki import broker_names, ensure_federation_tls
from broker_server.ops.security import load_or_create
from protofl import topics
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.credentials import read_device_file
from protofl.transport.mqtt import Backoff, MqttTransport, TransportError
from tests.conftest import EVENT_WAIT_S

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _leaf(d: Path, name: str, cn: str, san: str | None) -> None:
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={cn}",
        cwd=d,
    )
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        f"{name}.crt",
        "-days",
        "2",
        "-extfile",
        str(ext),
        cwd=d,
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a broker certificate for localhost / 127.0.0.1, a client certificate; and a second CA."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("certs")
    for ca in ("ca", "other-ca"):
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.crt",
            "-days",
            "2",
            "-subj",
            f"/CN=protofl test {ca}",
            cwd=d,
        )
    _leaf(d, "broker", "localhost", "DNS:localhost,IP:127.0.0.1")
    _leaf(d, "client", "dev-a", None)
    return d


def test_the_federation_ca_is_generated_once_and_travels_in_the_device_files(tmp_path: Path) -> None:
    sec = tmp_path / "sec"
    fed_tls = ensure_federation_tls(sec / "tls", "lab", broker_names("10.1.2.3"))
    ca, broker = fed_tls.ca_cert.read_bytes(), fed_tls.broker_cert.read_bytes()
    assert fed_tls.ca_key.stat().st_mode & 0o777 == 0o600 and fed_tls.broker_key.stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate(broker)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"10.1.2.3", "127.0.0.1", "::1"} <= {str(n) for n in names.get_values_for_type(x509.IPAddress)}
    assert {"localhost", socket.gethostname()} <= set(names.get_values_for_type(x509.DNSName))
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
    # A restart reuses both (devices keep their files); a new name re-signs the broker's, same CA.
    assert ensure_federation_tls(sec / "tls", "lab", broker_names("10.1.2.3")).broker_cert.read_bytes() == broker
    again = ensure_federation_tls(sec / "tls", "lab", broker_names("edge.lab"))
    assert again.ca_cert.read_bytes() == ca and again.broker_cert.read_bytes() != broker
    auth = load_or_create(sec, "lab", ["dev-a"], ca_pem=fed_tls.ca_pem())
    found = read_device_file(auth.device_file("dev-a"))
    assert found.ca_pem == ca.decode() and found.fed == "lab" and found.credentials.username == "dev-a"
    assert read_device_file(load_or_create(tmp_path / "plain", "lab", ["dev-a"]).device_file("dev-a")).ca_pem is None


def test_a_device_with_the_federation_ca_refuses_a_broker_it_did_not_sign(
    start_mosquitto, certs: Path, tmp_path: Path
) -> None:
    # The broker's certificate names 127.0.0.1 and is valid, but from another CA: refused, naming the file.
    broker, auth = tls_broker(start_mosquitto, certs, tmp_path, require_client_cert=False)
    ca = ensure_federation_tls(tmp_path / "fed-tls", "tls", ["127.0.0.1"]).ca_pem()
    opts = parse_broker_url(broker.url).with_auth("dev-a", auth.secrets.devices["dev-a"])
    with pytest.raises(
        TransportError, match="presented a certificate that the federation CA in --credentials dev-a.json did not sign"
    ):
        MqttTransport(
            opts.with_federation_ca(ca, "--credentials dev-a.json"), "dev-a", backoff=Backoff(0.1, 0.5)
        ).connect(2)


def tls_broker(start: Callable[..., MosquittoBroker], certs: Path, tmp_path: Path, require_client_cert: bool):
    auth = load_or_create(tmp_path / "sec", "tls", ["dev-a"])
    tls = ListenerTls(str(certs / "broker.crt"), str(certs / "broker.key"), str(certs / "ca.crt"), require_client_cert)
    return start(persistence=False, allow_anonymous=False, extra_config=auth.mosquitto_lines(), tls=tls), auth


def dev(url: str, auth, **tls: str) -> MqttTransport:
    opts = parse_broker_url(url).with_auth("dev-a", auth.secrets.devices["dev-a"], **tls)
    return MqttTransport(opts, "dev-a", backoff=Backoff(0.1, 0.5))


def test_tls_with_the_servers_ca_and_credentials(start_mosquitto, certs: Path, tmp_path: Path) -> None:
    broker, auth = tls_broker(start_mosquitto, certs, tmp_path, require_client_cert=False)
    assert broker.url.startswith("mqtts://127.0.0.1:")
    t = dev(broker.url, auth, tls_ca=str(certs / "ca.crt")).connect(10)
    t.publish(topics.presence("tls", "dev-a"), b"x")
    assert t.flush(5)
    t.close(timeout=1)
    # A CA that did not sign the broker's certificate: the device refuses the broker, naming the CA.
    with pytest.raises(
        TransportError, match=f"presented a certificate that the CA of --tls-ca {certs / 'other-ca.crt'} did not sign"
    ):
        dev(broker.url, auth, tls_ca=str(certs / "other-ca.crt")).connect(2)
    # Plain MQTT to the TLS port gets nowhere.
    with pytest.raises(TransportError):
        dev(broker.url.replace("mqtts", "mqtt"), auth).connect(2)


def test_tls_requiring_client_certificates(start_mosquitto, certs: Path, tmp_path: Path) -> None:
    broker, auth = tls_broker(start_mosquitto, certs, tmp_path, require_client_cert=True)
    # No client certificate: said as such, with the flags to pass (not "is it running?").
    with pytest.raises(
        TransportError,
        match="demanded a client certificate and refused the TLS handshake without "
        "one: pass --tls-cert FILE --tls-key FILE",
    ):
        dev(broker.url, auth, tls_ca=str(certs / "ca.crt")).connect(2)
    t = dev(
        broker.url,
        auth,
        tls_ca=str(certs / "ca.crt"),
        tls_cert=str(certs / "client.crt"),
        tls_key=str(certs / "client.key"),
    ).connect(10)
    assert t.connected
    t.close(timeout=1)


@pytest.mark.slow
def test_start_and_join_over_tls_with_client_certificates(certs: Path, tmp_path: Path) -> None:
    # Both CLIs: the server's own broker with a TLS listener that requires client certificates, passwords
    # and the ACL; one device joins with the CA, its certificate and its credentials file.
    port, state = free_port(), tmp_path / "state"
    tls = [
        "--tls-ca",
        str(certs / "ca.crt"),
        "--tls-cert",
        str(certs / "client.crt"),
        "--tls-key",
        str(certs / "client.key"),
    ]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "broker_server.cli",
            "start",
            "--preset",
            "fedproto",
            "--port",
            str(port),
            "--fed",
            "tls",
            "--rounds",
            "1",
            "--min-clients",
            "1",
            "--round-timeout",
            "60",
            "--state-dir",
            str(state),
            "--broker-cert",
            str(certs / "broker.crt"),
            "--broker-key",
            str(certs / "broker.key"),
            "--client-ca",
            str(certs / "ca.crt"),
            *tls,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=ENV,
        text=True,
    )
    device = None
    try:
        cred = state / "security" / "devices" / "device-1.json"
        end = time.monotonic() + 30
        while not cred.exists() and time.monotonic() < end:
            time.sleep(0.1)
        device = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edge_agent.cli",
                "join",
                "--broker",
                f"mqtts://localhost:{port}",
                "--fed",
                "tls",
                "--credentials",
                str(cred),
                "--data",
                "synthetic:n=200,n_test=40",
                "--threads",
                "1",
                "--connect-timeout",
                "30",
                *tls,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=ENV,
            text=True,
        )
        out, _ = server.communicate(timeout=120)
        dev_out, _ = device.communicate(timeout=EVENT_WAIT_S)
    finally:
        for p in (server, device):
            if p is not None and p.poll() is None:
                p.kill()
    assert server.returncode == 0, out
    assert "mosquitto listening on mqtts://127.0.0.1:" in out and "round 1/1: 1 clients (quorum)" in out, out
    assert device.returncode == 0 and "federation finished after 1 trained round(s)" in dev_out, dev_out
