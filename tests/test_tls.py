"""HTTPS with mutual TLS, CRLs, a separate management certificate set, and the 0.0.0.0 rule.

Certificates are made here with ``cryptography``; the server is the real one over TLS.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from mindie_host.config import ConfigError, config_from_dict
from mindie_host.server.admission import check_bind_addresses
from mindie_host.server.tls import TLSConfigError, build_ssl_context, tls_options
from mindie_host.testing import RunningServer, server_config

NOW = dt.datetime.now(dt.timezone.utc)


@dataclass
class Issued:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=1)).not_valid_after(NOW + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert, key)


def issue(ca: Issued, cn: str, *, server_ips: tuple[str, ...] = (), key: rsa.RSAPrivateKey | None = None) -> Issued:
    k = key or ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.cert.subject).public_key(k.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=1)).not_valid_after(NOW + dt.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if server_ips:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]), critical=False
        )
    return Issued(builder.sign(ca.key, hashes.SHA256()), k)


def write_pem(directory: Path, name: str, item: Issued) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    cert = directory / f"{name}.pem"
    key = directory / f"{name}.key.pem"
    cert.write_bytes(item.cert.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(item.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert, key


def write_crl(path: Path, ca: Issued, revoked: list[x509.Certificate]) -> None:
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca.cert.subject)
               .last_update(NOW - dt.timedelta(days=1)).next_update(NOW + dt.timedelta(days=30)))
    for cert in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(cert.serial_number).revocation_date(NOW).build()
        )
    path.write_bytes(builder.sign(ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))


@dataclass
class PKI:
    root: Path
    ca: Issued
    mgmt_ca: Issued

    def client(self, name: str) -> tuple[str, str]:
        return str(self.root / "clients" / f"{name}.pem"), str(self.root / "clients" / f"{name}.key.pem")

    def ca_file(self, management: bool = False) -> str:
        return str(self.root / "security" / "ca" / ("management_ca.pem" if management else "ca.pem"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    """An install dir with the spec's layout: security/ca, security/certs, security/keys, plus client certs."""
    root = tmp_path_factory.mktemp("install")
    ca, mgmt_ca, other_ca = make_ca("test root"), make_ca("management root"), make_ca("stranger root")
    (root / "security" / "ca").mkdir(parents=True)
    (root / "security" / "ca" / "ca.pem").write_bytes(ca.cert.public_bytes(serialization.Encoding.PEM))
    (root / "security" / "ca" / "management_ca.pem").write_bytes(mgmt_ca.cert.public_bytes(serialization.Encoding.PEM))
    server = issue(ca, "business", server_ips=("127.0.0.1",))
    _, key = write_pem(root / "security" / "certs", "server", server)
    (root / "security" / "keys").mkdir(exist_ok=True)
    key.rename(root / "security" / "keys" / "server.key.pem")
    mgmt = issue(mgmt_ca, "management", server_ips=("127.0.0.2",))
    _, mkey = write_pem(root / "security" / "certs" / "management", "server", mgmt)
    (root / "security" / "keys" / "management").mkdir(parents=True)
    mkey.rename(root / "security" / "keys" / "management" / "server.key.pem")
    clients = root / "clients"
    good = issue(ca, "good client")
    revoked = issue(ca, "revoked client")
    write_pem(clients, "good", good)
    write_pem(clients, "revoked", revoked)
    write_pem(clients, "stranger", issue(other_ca, "stranger client"))
    write_pem(clients, "mgmt", issue(mgmt_ca, "management client"))
    write_crl(root / "security" / "certs" / "server_crl.pem", ca, [revoked.cert])
    return PKI(root, ca, mgmt_ca)


def tls_server_config(tiny_model: Path, **server: object) -> dict:
    return server_config(tiny_model, server={
        "httpsEnabled": True,
        "tlsCaPath": "security/ca/", "tlsCaFile": ["ca.pem"],
        "tlsCert": "security/certs/server.pem", "tlsPk": "security/keys/server.key.pem", "tlsPkPwd": "",
        "tlsCrlPath": "security/certs/", "tlsCrlFiles": ["server_crl.pem"],
        **server,
    })


def client_context(pki: PKI, name: str | None, management: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki.ca_file(management))
    if name:
        ctx.load_cert_chain(*pki.client(name))
    return ctx


@pytest.fixture(scope="module")
def https_server(tiny_model: Path, pki: PKI) -> Iterator[RunningServer]:
    mp = pytest.MonkeyPatch()
    mp.setenv("MIES_INSTALL_PATH", str(pki.root))  # relative paths are under the install dir
    try:
        with RunningServer(tls_server_config(tiny_model)) as server:
            yield server
    finally:
        mp.undo()


def test_client_with_a_certificate_is_served(https_server: RunningServer, pki: PKI) -> None:
    assert https_server.url.startswith("https://")
    client = openai.OpenAI(base_url=https_server.url + "/v1", api_key="unused",
                           http_client=httpx.Client(verify=client_context(pki, "good"), timeout=60))
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert out.usage is not None and out.usage.completion_tokens == 3
    # the management plane shares the business IP, so it uses the business certificates
    r = httpx.get(https_server.management_url + "/v2/health/ready", verify=client_context(pki, "good"), timeout=30)
    assert r.status_code == 200
    r = httpx.get(https_server.metrics_url + "/metrics", verify=client_context(pki, "good"), timeout=30)
    assert r.status_code == 200


@pytest.mark.parametrize("who", [None, "stranger", "revoked"])
def test_clients_without_a_valid_certificate_are_refused(https_server: RunningServer, pki: PKI, who: str | None) -> None:
    with pytest.raises((httpx.TransportError, ssl.SSLError)):
        r = httpx.get(https_server.url + "/v1/models", verify=client_context(pki, who), timeout=30)
        r.raise_for_status()
    with pytest.raises((httpx.TransportError, ssl.SSLError)):
        httpx.get(https_server.management_url + "/v2/health/live", verify=client_context(pki, who), timeout=30)


def test_plain_http_is_refused(https_server: RunningServer) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(https_server.url.replace("https://", "http://") + "/v1/models", timeout=30)


def test_management_plane_uses_its_own_certificates(tiny_model: Path, pki: PKI,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIES_INSTALL_PATH", str(pki.root))
    cfg = tls_server_config(tiny_model, managementIpAddress="127.0.0.2", managementTlsCaFile=["management_ca.pem"],
                            managementTlsCrlPath="security/management/certs/", managementTlsPkPwd="")
    with RunningServer(cfg) as server:
        ok = httpx.get(server.management_url + "/v2/health/ready", verify=client_context(pki, "mgmt", True), timeout=30)
        assert ok.status_code == 200
        assert httpx.get(server.metrics_url + "/metrics", verify=client_context(pki, "mgmt", True),
                         timeout=30).status_code == 200
        # a business client certificate is not enough for the management plane, and vice versa
        with pytest.raises((httpx.TransportError, ssl.SSLError)):
            ctx = ssl.create_default_context(cafile=pki.ca_file(True))
            ctx.load_cert_chain(*pki.client("good"))
            httpx.get(server.management_url + "/v2/health/ready", verify=ctx, timeout=30)
        with pytest.raises((httpx.TransportError, ssl.SSLError)):
            httpx.get(server.url + "/v1/models", verify=client_context(pki, "mgmt"), timeout=30)
        r = httpx.get(server.url + "/v1/models", verify=client_context(pki, "good"), timeout=30)
        assert r.status_code == 200


def test_relative_paths_follow_the_config_file(tiny_model: Path, pki: PKI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MIES_INSTALL_PATH", raising=False)
    cfg = config_from_dict(tls_server_config(tiny_model), source_path=str(pki.root / "config.json"))
    assert tls_options(cfg, ("business",))["ssl_context_factory"](None, None).verify_mode == ssl.CERT_REQUIRED
    elsewhere = config_from_dict(tls_server_config(tiny_model), source_path=str(pki.root / "clients" / "config.json"))
    with pytest.raises(TLSConfigError, match="does not exist"):
        tls_options(elsewhere, ("business",))
    absolute = config_from_dict(tls_server_config(tiny_model, tlsCert=str(pki.root / "security/certs/server.pem"),
                                                  tlsPk=str(pki.root / "security/keys/server.key.pem"),
                                                  tlsCaPath=str(pki.root / "security/ca")))
    assert tls_options(absolute, ("management", "metrics"))


def test_short_rsa_keys_and_missing_ca_files_are_refused(pki: PKI, tmp_path: Path) -> None:
    weak = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert, key = write_pem(tmp_path, "weak", issue(pki.ca, "weak", server_ips=("127.0.0.1",), key=weak))
    with pytest.raises(TLSConfigError, match="at least RSA-3072"):
        build_ssl_context(cert, key, None, [Path(pki.ca_file())], [], "business plane")
    good_cert = pki.root / "security/certs/server.pem"
    good_key = pki.root / "security/keys/server.key.pem"
    with pytest.raises(TLSConfigError, match="CA file"):
        build_ssl_context(good_cert, good_key, None, [tmp_path / "nope.pem"], [], "business plane")
    ctx = build_ssl_context(good_cert, good_key, None, [], [], "business plane")
    assert ctx.verify_mode == ssl.CERT_NONE  # no CA => no client certificates asked for


def test_https_off_means_no_tls(tiny_model: Path) -> None:
    assert tls_options(config_from_dict(server_config(tiny_model)), ("business",)) == {}


def test_all_zero_address_needs_explicit_permission(tiny_model: Path) -> None:
    for key in ("ipAddress", "managementIpAddress"):
        with pytest.raises(ConfigError, match="allowAllZeroIpListening"):
            config_from_dict(server_config(tiny_model, server={key: "0.0.0.0"}))
    with pytest.raises(ConfigError, match="allowAllZeroIpListening"):
        config_from_dict(server_config(tiny_model), environ={"MIES_CONTAINER_IP": "0.0.0.0"})
    allowed = config_from_dict(server_config(tiny_model, server={"ipAddress": "0.0.0.0",
                                                                 "allowAllZeroIpListening": True}))
    check_bind_addresses(allowed)
    allowed.server.allowAllZeroIpListening = False  # changed after validation: the runner still refuses
    with pytest.raises(RuntimeError, match="allowAllZeroIpListening"):
        check_bind_addresses(allowed)
