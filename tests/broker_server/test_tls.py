"""TLS against a real Mosquitto, with certificates this test generates (openssl): server CA, client certs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from broker_server.broker import ListenerTls, MosquittoBroker, free_port
from broker_server.security import load_or_create
from protofl import topics
from protofl.transport.broker_url import parse_broker_url
from protofl.transport.mqtt import Backoff, MqttTransport, TransportError

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(REPO))


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _leaf(d: Path, name: str, cn: str, san: str | None) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", str(ext), cwd=d)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a broker certificate for localhost / 127.0.0.1, a client certificate; and a second CA."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("certs")
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                 f"{ca}.key", "-out", f"{ca}.crt", "-days", "2", "-subj", f"/CN=protofl test {ca}", cwd=d)
    _leaf(d, "broker", "localhost", "DNS:localhost,IP:127.0.0.1")
    _leaf(d, "client", "dev-a", None)
    return d


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
    # A CA that did not sign the broker's certificate: the device refuses the broker.
    with pytest.raises(TransportError, match="TLS with the broker at .* failed"):
        dev(broker.url, auth, tls_ca=str(certs / "other-ca.crt")).connect(2)
    # Plain MQTT to the TLS port gets nowhere.
    with pytest.raises(TransportError):
        dev(broker.url.replace("mqtts", "mqtt"), auth).connect(2)


def test_tls_requiring_client_certificates(start_mosquitto, certs: Path, tmp_path: Path) -> None:
    broker, auth = tls_broker(start_mosquitto, certs, tmp_path, require_client_cert=True)
    with pytest.raises(TransportError):
        dev(broker.url, auth, tls_ca=str(certs / "ca.crt")).connect(2)  # no client certificate
    t = dev(broker.url, auth, tls_ca=str(certs / "ca.crt"), tls_cert=str(certs / "client.crt"),
            tls_key=str(certs / "client.key")).connect(10)
    assert t.connected
    t.close(timeout=1)


@pytest.mark.slow
def test_start_and_join_over_tls_with_client_certificates(certs: Path, tmp_path: Path) -> None:
    # Both CLIs: the server's own broker with a TLS listener that requires client certificates, passwords
    # and the ACL; one device joins with the CA, its certificate and its credentials file.
    port, state = free_port(), tmp_path / "state"
    tls = ["--tls-ca", str(certs / "ca.crt"), "--tls-cert", str(certs / "client.crt"), "--tls-key",
           str(certs / "client.key")]
    server = subprocess.Popen(
        [sys.executable, "-m", "broker_server.cli", "start", "--preset", "fedproto", "--port", str(port),
         "--fed", "tls", "--rounds", "1", "--min-clients", "1", "--round-timeout", "60", "--state-dir", str(state),
         "--broker-cert", str(certs / "broker.crt"), "--broker-key", str(certs / "broker.key"),
         "--client-ca", str(certs / "ca.crt"), *tls], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
        text=True)
    device = None
    try:
        cred = state / "security" / "devices" / "device-1.json"
        end = time.monotonic() + 30
        while not cred.exists() and time.monotonic() < end:
            time.sleep(0.1)
        device = subprocess.Popen(
            [sys.executable, "-m", "edge_agent.cli", "join", "--broker", f"mqtts://localhost:{port}", "--fed", "tls",
             "--credentials", str(cred), "--data", "synthetic:n=200,n_test=40", "--threads", "1",
             "--connect-timeout", "30", *tls], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV, text=True)
        out, _ = server.communicate(timeout=120)
        dev_out, _ = device.communicate(timeout=30)
    finally:
        for p in (server, device):
            if p is not None and p.poll() is None:
                p.kill()
    assert server.returncode == 0, out
    assert "mosquitto listening on mqtts://127.0.0.1:" in out and "round 1/1: 1 clients (quorum)" in out, out
    assert device.returncode == 0 and "federation finished after 1 trained round(s)" in dev_out, dev_out
