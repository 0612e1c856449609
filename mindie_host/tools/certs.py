"""``mindie-host certs``: MindIE's CertTools (spec §8.1.2), the certificate importer and ``seceasy_encrypt``.

Certificates (``config_mindie_server_tls_cert.py``): ``import_cert``, ``import_ca``, ``import_crl`` and
``query`` put files where ``config.json`` names them (under ``MIES_INSTALL_PATH``, else the config
file's directory), after the spec's checks: X.509 v3, not expired, RSA keys of at least 3072 bits,
certificate and key matching, a CA that is a CA, a CRL that is current and signed by the first CA.
Files get the spec's import modes (CA, certificate and CRL 0600, key 0400). ``import_cert`` asks for
the key's password (or reads it from stdin when that is not a terminal) and stores it encrypted in
``tlsPkPwd`` (``managementTlsPkPwd`` with ``--business management``).

Secrets (``seceasy_encrypt``): ``create_keystore`` makes the master-key files ``kmcKsfMaster`` and
``kmcKsfStandby`` name; ``encrypt`` turns a secret (a key password, an ``apiKey``, an MS
``tls_passwd``) into a token to paste or a 0600 file to point at; ``update_master_key`` rotates the
master key and re-encrypts the files given; ``erase_keystore`` destroys both files. The master-key
files default to the server config's; ``--kmc-master``/``--kmc-standby`` name others (an MS config's).
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import os
import sys
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError, load_config
from ..file_modes import SECRET_MODE, write_file
from ..keystore import DEFAULT_LIFETIME_DAYS, MAX_AHEAD_DAYS, Keystore, KeystoreError, erase
from ..server.tls import MIN_RSA_BITS, resolve, security_base

CERT_MODE, KEY_MODE = 0o600, 0o400  # the spec's import modes (CA and CRL as certificates)
MAX_CA_FILES = 5


class CertError(ValueError):
    """A certificate, key or CRL that fails the spec's rules; the message names the file and the rule."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _load_cert(path: Path) -> Any:
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CertError(f"{path}: not a PEM certificate ({exc})") from None


def check_certificate(path: Path, *, ca: bool) -> Any:
    """The spec's certificate rules; returns the certificate. Warnings go to stderr."""
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import rsa

    cert = _load_cert(path)
    if cert.version.name != "v3":
        raise CertError(f"{path}: an X.509 {cert.version.name} certificate; allowed X.509 v3")
    now = _now()
    if cert.not_valid_after_utc <= now:
        raise CertError(f"{path}: expired on {cert.not_valid_after_utc:%Y-%m-%d}")
    if cert.not_valid_before_utc > now:
        raise CertError(f"{path}: not valid before {cert.not_valid_before_utc:%Y-%m-%d}")
    key = cert.public_key()
    if isinstance(key, rsa.RSAPublicKey) and key.key_size < MIN_RSA_BITS:
        raise CertError(f"{path}: an RSA-{key.key_size} key; allowed RSA of at least {MIN_RSA_BITS} bits (or EC)")
    algorithm = cert.signature_hash_algorithm.name if cert.signature_hash_algorithm else "none"
    if algorithm not in ("sha256", "sha512"):
        _warn(
            f"{path}: signed with {algorithm}; the spec recommends sha256WithRSAEncryption or sha512WithRSAEncryption"
        )
    if ca:
        try:
            basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            basic = None
        if basic is None or not basic.ca:
            raise CertError(f"{path}: not a CA certificate (no basicConstraints CA:TRUE)")
        try:
            usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
            signs = usage.key_cert_sign and usage.crl_sign
        except x509.ExtensionNotFound:
            signs = False
        if not signs:
            _warn(f"{path}: its key usage lacks Certificate Sign and CRL Sign, which the spec recommends")
    return cert


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _read_secret(prompt: str) -> str:
    """A secret from the terminal (not echoed), or one line of stdin when stdin is not a terminal."""
    if sys.stdin.isatty():
        return getpass.getpass(prompt)
    return sys.stdin.readline().rstrip("\r\n")


class Paths:
    """Where a config puts the TLS files of one plane (``business`` or ``management``) and the master-key files."""

    def __init__(self, config: Config, business: str) -> None:
        s, base = config.server, security_base(config)
        self.base = base
        self.ca_dir = resolve(base, s.tlsCaPath)
        if business == "management":
            self.cert, self.key, self.pwd = s.managementTlsCert, s.managementTlsPk, s.managementTlsPkPwd
            self.ca_names, self.crl_dir, self.crl_names = (
                s.managementTlsCaFile,
                s.managementTlsCrlPath,
                s.managementTlsCrlFiles,
            )
            self.pwd_key = "managementTlsPkPwd"
        else:
            self.cert, self.key, self.pwd = s.tlsCert, s.tlsPk, s.tlsPkPwd
            self.ca_names, self.crl_dir, self.crl_names = s.tlsCaFile, s.tlsCrlPath, s.tlsCrlFiles
            self.pwd_key = "tlsPkPwd"
        self.kmc = (resolve(base, s.kmcKsfMaster), resolve(base, s.kmcKsfStandby))

    def at(self, value: str) -> Path:
        return resolve(self.base, value)


def _config(args: argparse.Namespace) -> Config:
    path = args.config or os.environ.get("MIES_CONFIG_JSON_PATH")
    return load_config(path) if path else Config()


def _kmc(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.kmc_master or args.kmc_standby:
        if not (args.kmc_master and args.kmc_standby):
            raise CertError("--kmc-master and --kmc-standby go together")
        return Path(args.kmc_master), Path(args.kmc_standby)
    return Paths(_config(args), "business").kmc


def _keystore(kmc: tuple[Path, Path], create: bool = True) -> Keystore:
    if create and not kmc[0].exists() and not kmc[1].exists():
        store = Keystore.create(*kmc)
        print(f"created the master-key files {kmc[0]} and {kmc[1]} (mode 0600; back them up together)", file=sys.stderr)
        return store
    return Keystore.load(*kmc)


def _install(source: Path, target: Path, mode: int) -> None:
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_file(target, source.read_bytes(), mode)
    print(f"imported {source} -> {target} (mode {mode:04o})")


# -- commands ---------------------------------------------------------------------------------------------
def cmd_import_cert(args: argparse.Namespace) -> int:
    from cryptography.hazmat.primitives import serialization

    paths = Paths(_config(args), args.business)
    cert_path, key_path = Path(args.cert), Path(args.key)
    cert = check_certificate(cert_path, ca=False)
    raw_key = key_path.read_bytes()
    encrypted = b"ENCRYPTED" in raw_key
    password = _read_secret(f"password of {key_path}: ") if encrypted else ""
    try:
        key = serialization.load_pem_private_key(raw_key, password.encode() if encrypted else None)
    except (TypeError, ValueError) as exc:
        raise CertError(f"{key_path}: cannot be read with the password given ({exc})") from None
    if key.public_key().public_numbers() != cert.public_key().public_numbers():
        raise CertError(f"{key_path} does not match {cert_path}: their public keys differ")
    if not encrypted:
        _warn(f"{key_path} is not encrypted: anyone who can read the file has the key; encrypt it with a password")
    _install(cert_path, paths.at(paths.cert), CERT_MODE)
    _install(key_path, paths.at(paths.key), KEY_MODE)
    if encrypted:
        if not paths.pwd:
            raise CertError(f"ServerConfig.{paths.pwd_key} is empty: there is nowhere to store the key's password")
        token = _keystore(paths.kmc).encrypt(password)
        target = paths.at(paths.pwd)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_file(target, token + "\n", SECRET_MODE)
        print(f"the key's password is stored encrypted in {target} (ServerConfig.{paths.pwd_key})")
    return 0


def cmd_import_ca(args: argparse.Namespace) -> int:
    if len(args.files) > MAX_CA_FILES:
        raise CertError(f"{len(args.files)} CA files; allowed at most {MAX_CA_FILES} at a time")
    paths = Paths(_config(args), args.business)
    for name in args.files:
        source = Path(name)
        check_certificate(source, ca=True)
        _install(source, paths.ca_dir / source.name, CERT_MODE)
        if source.name not in paths.ca_names:
            _warn(f"{source.name} is not listed in the config's CA files {paths.ca_names}; add it there to use it")
    return 0


def cmd_import_crl(args: argparse.Namespace) -> int:
    from cryptography import x509

    paths = Paths(_config(args), args.business)
    source = Path(args.file)
    try:
        crl = x509.load_pem_x509_crl(source.read_bytes())
    except (OSError, ValueError) as exc:
        raise CertError(f"{source}: not a PEM certificate revocation list ({exc})") from None
    if crl.next_update_utc is not None and crl.next_update_utc <= _now():
        raise CertError(f"{source}: expired (its next update was due {crl.next_update_utc:%Y-%m-%d})")
    cas = [paths.ca_dir / n for n in paths.ca_names if n]
    if not cas or not cas[0].is_file():
        raise CertError(
            f"the CRL pairs with the first CA file ({cas[0] if cas else 'none configured'}), which is "
            "not there; import_ca it first"
        )
    if not crl.is_signature_valid(_load_cert(cas[0]).public_key()):
        raise CertError(f"{source} is not signed by the first CA {cas[0]}")
    names = [n for n in paths.crl_names if n]
    if not names:
        raise CertError("the config names no CRL file (tlsCrlFiles)")
    _install(source, resolve(paths.base, paths.crl_dir, names[0]), CERT_MODE)
    return 0


def cmd_query(args: argparse.Namespace) -> int:
    from cryptography import x509

    paths = Paths(_config(args), args.business)
    files = [("certificate", paths.at(paths.cert))] + [("CA", paths.ca_dir / n) for n in paths.ca_names if n]
    for kind, path in files:
        if not path.is_file():
            print(f"{kind} {path}: not there")
            continue
        cert = _load_cert(path)
        days = (cert.not_valid_after_utc - _now()).days
        print(
            f"{kind} {path}: subject {cert.subject.rfc4514_string()}, issuer {cert.issuer.rfc4514_string()}, "
            f"expires {cert.not_valid_after_utc:%Y-%m-%d} (in {days} days), serial {cert.serial_number}"
        )
    for name in (n for n in paths.crl_names if n):
        path = resolve(paths.base, paths.crl_dir, name)
        if path.is_file():
            crl = x509.load_pem_x509_crl(path.read_bytes())
            print(f"CRL {path}: {len(crl)} revoked, next update {crl.next_update_utc:%Y-%m-%d}")
    if paths.kmc[0].exists() or paths.kmc[1].exists():
        store = Keystore.load(*paths.kmc)
        key = store.active_key
        print(f"master key {key.id} ({paths.kmc[0]}, {paths.kmc[1]}): expires {key.expires:%Y-%m-%d}")
    return 0


def cmd_create_keystore(args: argparse.Namespace) -> int:
    kmc = _kmc(args)
    Keystore.create(*kmc, lifetime_days=args.lifetime_days)
    print(f"created the master-key files {kmc[0]} and {kmc[1]} (mode 0600)")
    return 0


def cmd_encrypt(args: argparse.Namespace) -> int:
    secret = _read_secret("secret to encrypt: ")
    if not secret:
        raise CertError("the secret is empty")
    token = _keystore(_kmc(args)).encrypt(secret)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_file(args.out, token + "\n", SECRET_MODE)
        print(f"wrote {args.out} (mode 0600)")
    else:
        print(token)
    return 0


def cmd_update_master_key(args: argparse.Namespace) -> int:
    kmc = _kmc(args)
    store = Keystore.load(*kmc)
    done = store.rotate(args.files, ahead_days=args.ahead_days, force=args.force, lifetime_days=args.lifetime_days)
    if not done:
        print(
            f"master key {store.active} expires {store.active_key.expires:%Y-%m-%d}, more than {args.ahead_days} "
            "days from now: not rotated (--force rotates anyway)"
        )
        return 0
    print(f"master key {store.active} is active; re-encrypted {', '.join(map(str, done))}; the old key is deleted")
    return 0


def cmd_erase_keystore(args: argparse.Namespace) -> int:
    if not args.yes:
        raise CertError("erasing the master key makes every secret encrypted under it unreadable; add --yes")
    gone = erase(*_kmc(args))
    print("erased " + (", ".join(map(str, gone)) if gone else "nothing (no master-key file was there)"))
    return 0


COMMANDS = {
    "import_cert": cmd_import_cert,
    "import_ca": cmd_import_ca,
    "import_crl": cmd_import_crl,
    "query": cmd_query,
    "create_keystore": cmd_create_keystore,
    "encrypt": cmd_encrypt,
    "update_master_key": cmd_update_master_key,
    "erase_keystore": cmd_erase_keystore,
}


def add_certs_parser(sub: Any) -> None:
    """``mindie-host certs <command>``."""
    p = sub.add_parser("certs", help="import certificates, encrypt secrets, rotate or erase the master key (CertTools)")
    p.set_defaults(run=run)
    csub = p.add_subparsers(dest="certs_cmd", required=True)

    def command(name: str, help_text: str, business: bool = False) -> argparse.ArgumentParser:
        c = csub.add_parser(name, help=help_text)
        c.add_argument("--config", help="the server's config.json (default: $MIES_CONFIG_JSON_PATH, else defaults)")
        if business:
            c.add_argument(
                "--business",
                choices=["https", "management"],
                default="https",
                help="which certificate set: the business plane's (default) or the management plane's",
            )
        else:
            c.add_argument("--kmc-master", help="the primary master-key file (default: the config's kmcKsfMaster)")
            c.add_argument("--kmc-standby", help="the standby master-key file (default: the config's kmcKsfStandby)")
        return c

    c = command(
        "import_cert",
        "check and import a certificate and its private key; store the key's password encrypted",
        business=True,
    )
    c.add_argument("cert")
    c.add_argument("key")
    c = command("import_ca", "check and import CA certificates (at most 5)", business=True)
    c.add_argument("files", nargs="+")
    c = command("import_crl", "check and import a CRL (it pairs with the first CA file)", business=True)
    c.add_argument("file")
    command("query", "show the imported certificates, CRLs and the master key's expiry", business=True)
    c = command("create_keystore", "make the master-key files")
    c.add_argument("--lifetime-days", type=int, default=DEFAULT_LIFETIME_DAYS, help="days until the key expires")
    c = command("encrypt", "encrypt a secret read from the terminal (or stdin) under the master key")
    c.add_argument("--out", help="write the token to this file (mode 0600) instead of printing it")
    c = command("update_master_key", "rotate the master key and re-encrypt the files given")
    c.add_argument("files", nargs="+", help="files holding encrypted secrets (password files, config files)")
    c.add_argument(
        "--ahead-days",
        type=int,
        default=0,
        help=f"rotate when the key expires within this many days, [0, {MAX_AHEAD_DAYS}] (default 0)",
    )
    c.add_argument("--force", action="store_true", help="rotate whatever the expiry")
    c.add_argument("--lifetime-days", type=int, default=DEFAULT_LIFETIME_DAYS, help="days until the new key expires")
    c = command("erase_keystore", "overwrite and delete the master-key files (when uninstalling)")
    c.add_argument("--yes", action="store_true", help="confirm: every secret encrypted under the key is lost")


def run(args: argparse.Namespace) -> int:
    """Run one ``certs`` command: 0 on success, 1 with the reason on stderr."""
    try:
        return COMMANDS[args.certs_cmd](args)
    except (CertError, KeystoreError, ConfigError, OSError) as exc:
        print(f"mindie-host certs {args.certs_cmd}: {exc}", file=sys.stderr)
        return 1
