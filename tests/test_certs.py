"""CertTools (spec §8.1.2): certificates imported with the spec's checks and modes, secrets encrypted under a master
key (primary and standby files), read by a real HTTPS server and the MS coordinator, rotated and erased.

Certificates are made here with ``cryptography`` (an RSA-3072 server key encrypted with a password); the clients
are real TLS clients (httpx, the OpenAI SDK)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import io
import json
import logging
import ssl
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from test_tls import Issued, _name, issue, make_ca, write_crl, write_pem

from mindie_host.cli import main
from mindie_host.config import config_from_dict
from mindie_host.file_modes import ENV_CHECK, write_file
from mindie_host.keystore import Keystore, KeystoreError, SecretReader
from mindie_host.ms.coordinator.app import serve_coordinator
from mindie_host.ms.coordinator.config import coordinator_config_from_dict, default_coordinator_dict
from mindie_host.server.tls import tls_options
from mindie_host.testing import RunningServer, free_port, server_config

PASSWORD = "correct horse battery"
API_KEY = "sk-mindie-0123456789"
NOW = dt.datetime.now(dt.timezone.utc)


def certs(*args: str, stdin: str = "") -> tuple[int, str, str]:
    """Run ``mindie-host certs ...`` in this process with ``stdin`` (not a terminal: one line is read)."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["certs", *args])
    finally:
        sys.stdin = saved
    return code, out.getvalue(), err.getvalue()


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def encrypted_key(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey, password: str = PASSWORD) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(password.encode()),
    )


@dataclass
class Install:
    root: Path
    config: Path
    server_cfg: dict
    ca: Issued

    def path(self, relative: str) -> Path:
        return self.root / relative

    def kmc(self) -> tuple[Path, Path]:
        return self.path("tools/pmt/master/ksfa"), self.path("tools/pmt/standby/ksfb")

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.path("security/ca/ca.pem")))
        ctx.load_cert_chain(str(self.root / "clients/client.pem"), str(self.root / "clients/client.key.pem"))
        return ctx


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Install]:
    """An install dir whose CA, server certificate, encrypted key password and apiKey went in through the tools."""
    root = tmp_path_factory.mktemp("certtools")
    mp = pytest.MonkeyPatch()
    mp.setenv("MIES_INSTALL_PATH", str(root))
    mp.delenv(ENV_CHECK, raising=False)
    ca = make_ca("certtools root")
    incoming = root / "incoming"
    incoming.mkdir()
    write_file(incoming / "ca.pem", pem(ca.cert), 0o600)
    server = issue(ca, "server", server_ips=("127.0.0.1",), key=rsa.generate_private_key(65537, 3072))
    write_file(incoming / "server.pem", pem(server.cert), 0o600)
    write_file(incoming / "server.key.pem", encrypted_key(server.key), 0o600)
    write_pem(root / "clients", "client", issue(ca, "client"))
    cfg = server_config(
        tiny_model,
        server={
            "engineProcess": False,  # TLS and secrets are the point: no engine process to start
            "httpsEnabled": True,
            "tlsCaPath": "security/ca/",
            "tlsCaFile": ["ca.pem"],
            "tlsCert": "security/certs/server.pem",
            "tlsPk": "security/keys/server.key.pem",
            "tlsPkPwd": "security/pass/key_pwd.txt",
            "tlsCrlPath": "security/certs/",
            "tlsCrlFiles": ["server_crl.pem"],
        },
    )
    config = root / "conf" / "config.json"
    config.parent.mkdir()
    write_file(config, json.dumps(cfg))
    try:
        assert certs("import_ca", str(incoming / "ca.pem"), "--config", str(config))[0] == 0
        code, out, err = certs(
            "import_cert",
            str(incoming / "server.pem"),
            str(incoming / "server.key.pem"),
            "--config",
            str(config),
            stdin=PASSWORD + "\n",
        )
        assert code == 0, err
        code, token, err = certs("encrypt", "--config", str(config), stdin=API_KEY + "\n")
        assert code == 0, err
        cfg["ServerConfig"]["apiKey"] = token.strip()
        write_file(config, json.dumps(cfg))
        yield Install(root, config, cfg, ca)
    finally:
        mp.undo()


def test_imported_files_have_the_spec_modes_and_no_secret_in_plain_text(install: Install) -> None:
    modes = {
        "security/ca/ca.pem": 0o600,
        "security/certs/server.pem": 0o600,
        "security/keys/server.key.pem": 0o400,
        "security/pass/key_pwd.txt": 0o600,
        "tools/pmt/master/ksfa": 0o600,
        "tools/pmt/standby/ksfb": 0o600,
    }
    for relative, mode in modes.items():
        assert install.path(relative).stat().st_mode & 0o777 == mode, relative
    assert install.path("security/pass/key_pwd.txt").read_text().startswith("MHK1:1:")
    for path in install.root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert PASSWORD.encode() not in data and API_KEY.encode() not in data, path
    assert install.server_cfg["ServerConfig"]["apiKey"].startswith("MHK1:1:")


def test_https_server_reads_the_encrypted_password_and_api_key(install: Install) -> None:
    with RunningServer(install.server_cfg) as server:
        assert server.url.startswith("https://")
        http = httpx.Client(verify=install.client_context(), timeout=60)
        assert http.get(server.url + "/v1/models").status_code == 401
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, http_client=http)
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
        with pytest.raises((httpx.TransportError, ssl.SSLError)):  # the server's certificate is checked
            httpx.get(server.url + "/v1/models", verify=ssl.create_default_context(), timeout=30)


def test_query_lists_what_was_imported(install: Install) -> None:
    code, out, _ = certs("query", "--config", str(install.config))
    assert code == 0
    assert "certificate " + str(install.path("security/certs/server.pem")) in out and "CN=server" in out
    assert "CA " in out and "master key 1" in out


def test_a_damaged_primary_is_rebuilt_from_the_standby(install: Install, caplog: pytest.LogCaptureFixture) -> None:
    primary, standby = install.kmc()
    saved = primary.read_bytes()
    write_file(primary, saved[: len(saved) // 2], 0o600)  # a torn write
    cfg = config_from_dict(install.server_cfg)
    with caplog.at_level(logging.WARNING, "mindie_host.keystore"):
        assert tls_options(cfg, ("business",))
    assert f"master-key file {primary}" in caplog.text and "rewriting it from the other file" in caplog.text
    assert json.loads(primary.read_bytes())["keys"] == json.loads(standby.read_bytes())["keys"]
    primary.unlink()  # a lost primary too
    assert SecretReader(primary, standby, "test").reveal(install.server_cfg["ServerConfig"]["apiKey"], "k") == API_KEY
    assert primary.is_file()
    saved_standby = standby.read_bytes()
    write_file(primary, b"{}", 0o600)
    write_file(standby, b"x", 0o600)
    with pytest.raises(KeystoreError) as err:
        Keystore.load(primary, standby)
    assert str(primary) in str(err.value) and str(standby) in str(err.value)
    write_file(primary, saved, 0o600)
    write_file(standby, saved_standby, 0o600)


def test_rotation_re_encrypts_the_files_and_retires_the_old_key(install: Install) -> None:
    pwd = install.path("security/pass/key_pwd.txt")
    old_token = pwd.read_text().strip()
    code, out, _ = certs(
        "update_master_key", str(pwd), str(install.config), "--ahead-days", "30", "--config", str(install.config)
    )
    assert code == 0 and "not rotated" in out  # the key has a year left
    assert certs("update_master_key", str(pwd), "--ahead-days", "1826", "--config", str(install.config))[0] == 1
    code, out, err = certs(
        "update_master_key", str(pwd), str(install.config), "--force", "--config", str(install.config)
    )
    assert code == 0, err
    new_cfg = json.loads(install.config.read_text())
    assert pwd.read_text().startswith("MHK1:2:") and new_cfg["ServerConfig"]["apiKey"].startswith("MHK1:2:")
    assert install.config.stat().st_mode & 0o777 == 0o640 and pwd.stat().st_mode & 0o777 == 0o600
    store = Keystore.load(*install.kmc())
    assert list(store.keys) == [2]
    with pytest.raises(KeystoreError, match="master key 1, which .* no longer holds"):
        store.decrypt(old_token, str(pwd))
    cfg = config_from_dict(new_cfg)
    assert tls_options(cfg, ("business",))  # the key still loads with the re-encrypted password
    assert SecretReader(*install.kmc(), "test").reveal(new_cfg["ServerConfig"]["apiKey"], "apiKey") == API_KEY
    install.server_cfg = new_cfg


def test_the_coordinator_reads_an_encrypted_tls_passwd(install: Install) -> None:
    """The MS spelling of the items: tls_passwd encrypted under kmcKsfMaster/kmcKsfStandby."""
    items = {
        "ca_cert": str(install.path("security/ca/ca.pem")),
        "tls_cert": str(install.path("security/certs/server.pem")),
        "tls_key": str(install.path("security/keys/server.key.pem")),
        "tls_passwd": str(install.path("security/pass/key_pwd.txt")),
        "tls_crl": "",
        "kmcKsfMaster": str(install.kmc()[0]),
        "kmcKsfStandby": str(install.kmc()[1]),
    }
    cfg = default_coordinator_dict()
    predict, manage = free_port(), free_port()
    cfg["http_config"].update(predict_port=str(predict), manage_port=str(manage))
    cfg["tls_config"].update(controller_server_tls_enable=True, controller_server_tls_items=items)
    config = coordinator_config_from_dict(cfg, environ={})
    loop, stop = asyncio.new_event_loop(), asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve_coordinator(config, stop),), daemon=True)
    thread.start()
    try:
        with httpx.Client(verify=install.client_context(), timeout=30) as c:
            for _ in range(100):
                try:
                    r = c.get(f"https://127.0.0.1:{manage}/v1/startup")
                    break
                except httpx.ConnectError:
                    threading.Event().wait(0.1)
            assert r.status_code == 200
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=30)
    no_kmc = {**items, "kmcKsfMaster": "", "kmcKsfStandby": ""}
    cfg["tls_config"]["controller_server_tls_items"] = no_kmc
    with pytest.raises(KeystoreError, match="is encrypted, but controller_server_tls_items names no master-key"):
        coordinator_config_from_dict(cfg, environ={}).tls["controller_server"].server_context()


def test_erase_destroys_both_files(install: Install) -> None:
    code, _, err = certs("erase_keystore", "--config", str(install.config))
    assert code == 1 and "add --yes" in err
    assert certs("erase_keystore", "--yes", "--config", str(install.config))[0] == 0
    assert not any(p.exists() for p in install.kmc())
    with pytest.raises(KeystoreError, match="no usable master-key file"):
        tls_options(config_from_dict(install.server_cfg), ("business",))


def _expired_cert(ca: Issued) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("old"))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(days=30))
        .not_valid_after(NOW - dt.timedelta(days=1))
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(cert, key)


def test_imports_refuse_what_the_spec_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIES_INSTALL_PATH", str(tmp_path))
    config = tmp_path / "config.json"
    write_file(config, json.dumps({"ServerConfig": {"httpsEnabled": False}}))
    ca, other = make_ca("root"), make_ca("other root")
    write_file(tmp_path / "ca.pem", pem(ca.cert), 0o600)

    def refused(*args: str, stdin: str = PASSWORD + "\n") -> str:
        code, _, err = certs(*args, "--config", str(config), stdin=stdin)
        assert code == 1
        return err

    def files(name: str, item: Issued, password: str | None = PASSWORD) -> tuple[str, str]:
        cert, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key.pem"
        write_file(cert, pem(item.cert), 0o600)
        write_file(
            key,
            encrypted_key(item.key, password)
            if password
            else item.key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            0o600,
        )
        return str(cert), str(key)

    assert "expired on" in refused("import_cert", *files("old", _expired_cert(ca)))
    weak = issue(ca, "weak", key=rsa.generate_private_key(65537, 2048))
    assert "RSA-2048 key; allowed RSA of at least 3072" in refused("import_cert", *files("weak", weak))
    good_cert, _ = files("good", issue(ca, "good"))
    _, other_key = files("other", issue(ca, "other"))
    assert "does not match" in refused("import_cert", good_cert, other_key)
    assert "cannot be read with the password given" in refused(
        "import_cert", *files("pw", issue(ca, "pw")), stdin="wrong\n"
    )
    leaf, _ = files("leaf", issue(ca, "leaf"))
    assert "not a CA certificate" in refused("import_ca", leaf)
    assert "at most 5" in refused("import_ca", *[str(tmp_path / "ca.pem")] * 6)
    assert "not a PEM certificate revocation list" in refused("import_crl", str(tmp_path / "ca.pem"))
    write_crl(tmp_path / "crl.pem", ca, [])
    assert "pairs with the first CA file" in refused("import_crl", str(tmp_path / "crl.pem"))
    assert certs("import_ca", str(tmp_path / "ca.pem"), "--config", str(config))[0] == 0
    write_crl(tmp_path / "foreign_crl.pem", other, [])
    assert "is not signed by the first CA" in refused("import_crl", str(tmp_path / "foreign_crl.pem"))
    stale = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.cert.subject)
        .last_update(NOW - dt.timedelta(days=9))
        .next_update(NOW - dt.timedelta(days=2))
        .sign(ca.key, hashes.SHA256())
    )
    write_file(tmp_path / "stale_crl.pem", stale.public_bytes(serialization.Encoding.PEM), 0o600)
    assert "expired (its next update was due" in refused("import_crl", str(tmp_path / "stale_crl.pem"))
    assert certs("import_crl", str(tmp_path / "crl.pem"), "--config", str(config))[0] == 0
    assert (tmp_path / "security/certs/server_crl.pem").stat().st_mode & 0o777 == 0o600


def test_plain_text_passwords_still_load_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ca = make_ca("root")
    item = issue(ca, "server", server_ips=("127.0.0.1",))
    cert, key = tmp_path / "s.pem", tmp_path / "s.key.pem"
    write_file(cert, pem(item.cert), 0o600)
    write_file(key, encrypted_key(item.key), 0o600)
    pwd = write_file(tmp_path / "pwd.txt", PASSWORD, 0o600)
    from mindie_host.server.tls import build_ssl_context

    with caplog.at_level(logging.WARNING, "mindie_host.keystore"):
        assert build_ssl_context(cert, key, pwd, [], [], "business plane")
    assert f"{pwd} holds a secret in plain text; encrypt it" in caplog.text
