"""TLS for the listeners (``httpsEnabled``): which certificate, key, CA and CRL files each plane uses.

* the business listener uses ``tlsCert``/``tlsPk``/``tlsPkPwd``, CA files
  ``tlsCaPath``+``tlsCaFile`` and CRLs ``tlsCrlPath``+``tlsCrlFiles``;
* the management and metrics listeners use the ``managementTls*`` set (CA files
  under ``tlsCaPath`` as in MindIE) when ``managementIpAddress`` differs from
  ``ipAddress``, and the business set otherwise;
* CA files present => mutual TLS (clients must show a certificate the CA signed);
  CRL files present => revoked client certificates are refused;
* relative paths are under ``MIES_INSTALL_PATH`` when set, else under the config
  file's directory, else the working directory; absolute paths are used as is;
* an RSA server key shorter than 3072 bits is refused (the spec's rule);
* ``tlsPkPwd`` names a file holding the key's password, encrypted under the master key in
  ``kmcKsfMaster``/``kmcKsfStandby`` (:mod:`mindie_host.keystore`; plain text is read with a
  warning); ``apiKey`` may be such a token too (:func:`secret_reader`).

Who may send what once connected is :mod:`.admission`'s job.
"""

from __future__ import annotations

import logging
import os
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..file_modes import SECRET_MODE, FileModeError, check_mode
from ..keystore import SecretReader

if TYPE_CHECKING:
    from ..config import Config, ServerConfig

log = logging.getLogger("mindie_host.server")

MIN_RSA_BITS = 3072


class TLSConfigError(RuntimeError):
    """A certificate, key, CA or CRL file named by the config is missing or unusable."""


def security_base(config: Config) -> Path:
    """The directory relative TLS paths start from (see the module docstring)."""
    install = os.environ.get("MIES_INSTALL_PATH")
    if install:
        return Path(install)
    if config.source_path:
        return Path(config.source_path).resolve().parent
    return Path.cwd()


def resolve(base: Path, *parts: str) -> Path:
    """Join ``parts`` under ``base``; an absolute part restarts the path."""
    path = base
    for part in parts:
        path = path / Path(part).expanduser()
    return path


def _files(base: Path, directory: str, names: list[str]) -> list[Path]:
    return [resolve(base, directory, name) for name in names if name]


def secret_reader(config: Config) -> SecretReader:
    """Decrypts the server's secrets under ``kmcKsfMaster``/``kmcKsfStandby`` (relative to :func:`security_base`)."""
    base, s = security_base(config), config.server
    return SecretReader(
        resolve(base, s.kmcKsfMaster) if s.kmcKsfMaster else None,
        resolve(base, s.kmcKsfStandby) if s.kmcKsfStandby else None,
        "ServerConfig",
    )


def read_password(path: Path | None, secrets: SecretReader | None = None) -> str | None:
    """A key-password file's secret: a token decrypts under ``secrets``' keystore, plain text is used as it is."""
    return (secrets or SecretReader(None, None, "this component")).read_file(path)


def _check_key_strength(key_path: Path, password: str | None) -> None:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
    except ImportError:  # optional: without it the key length is not checked
        log.warning("the 'cryptography' package is not installed; the server key length is not checked")
        return
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password.encode() if password else None)
    except (TypeError, ValueError) as exc:
        raise TLSConfigError(f"cannot read private key {key_path}: {exc} (is the password file right?)") from exc
    if isinstance(key, rsa.RSAPrivateKey) and key.key_size < MIN_RSA_BITS:
        raise TLSConfigError(
            f"private key {key_path} is RSA-{key.key_size}; the server key must be at least RSA-{MIN_RSA_BITS} "
            "(or an EC key)"
        )


def check_tls_file_modes(paths: list[Path | None], what: str) -> None:
    """``MINDIE_CHECK_INPUTFILES_PERMISSION``: certificates, keys, CA/CRL and password files at most 0600."""
    for path in paths:
        if path is None:
            continue
        try:
            check_mode(path, SECRET_MODE, f"a TLS file of the {what}")
        except FileModeError as exc:
            raise TLSConfigError(f"{what}: {exc}") from None


def build_ssl_context(
    cert: Path,
    key: Path,
    password_file: Path | None,
    ca_files: list[Path],
    crl_files: list[Path],
    what: str,
    secrets: SecretReader | None = None,
) -> ssl.SSLContext:
    """A server-side context: our cert and key, client certificates required if CA files are given."""
    for path, name in ((cert, "certificate"), (key, "private key")):
        if not path.is_file():
            raise TLSConfigError(f"{what}: TLS {name} {path} does not exist")
    check_tls_file_modes([cert, key, password_file, *ca_files, *crl_files], what)
    password = read_password(password_file, secrets)
    _check_key_strength(key, password)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key), password=password)
    except ssl.SSLError as exc:
        raise TLSConfigError(f"{what}: cannot load {cert} with {key}: {exc}") from exc
    cas = [p for p in ca_files if p.is_file()]
    missing = [p for p in ca_files if not p.is_file()]
    if missing:
        raise TLSConfigError(f"{what}: CA file(s) not found: {', '.join(map(str, missing))}")
    for ca in cas:
        ctx.load_verify_locations(cafile=str(ca))
    if cas:
        ctx.verify_mode = ssl.CERT_REQUIRED
        crls = [p for p in crl_files if p.is_file()]
        for crl in crls:
            ctx.load_verify_locations(cafile=str(crl))
        if crls:
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        elif crl_files:
            log.info("%s: no CRL file found (%s); revocation is not checked", what, ", ".join(map(str, crl_files)))
    return ctx


def plane_ssl_context(config: Config, planes: tuple[str, ...]) -> ssl.SSLContext | None:
    """The SSL context for a listener serving ``planes``, or None when HTTPS is off."""
    s: ServerConfig = config.server
    if not s.httpsEnabled:
        return None
    base = security_base(config)
    if "business" not in planes and s.managementIpAddress != s.ipAddress:  # the management plane's own files
        cert, key, pwd, cas, crl_path, crls = (
            s.managementTlsCert,
            s.managementTlsPk,
            s.managementTlsPkPwd,
            s.managementTlsCaFile,
            s.managementTlsCrlPath,
            s.managementTlsCrlFiles,
        )
    else:
        cert, key, pwd, cas, crl_path, crls = s.tlsCert, s.tlsPk, s.tlsPkPwd, s.tlsCaFile, s.tlsCrlPath, s.tlsCrlFiles
    return build_ssl_context(
        cert=resolve(base, cert),
        key=resolve(base, key),
        password_file=resolve(base, pwd) if pwd else None,
        ca_files=_files(base, s.tlsCaPath, cas),
        crl_files=_files(base, crl_path, crls),
        what="business plane" if "business" in planes else "management plane",
        secrets=secret_reader(config),
    )


def tls_options(config: Config, planes: tuple[str, ...]) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for a listener (empty when HTTPS is off).

    The context is built here, so a bad certificate fails before anything listens.
    """
    ctx = plane_ssl_context(config, planes)
    if ctx is None:
        return {}
    import inspect

    import uvicorn

    if "ssl_context_factory" not in inspect.signature(uvicorn.Config.__init__).parameters:
        raise TLSConfigError("HTTPS needs a uvicorn whose Config takes ssl_context_factory; pip install -U uvicorn")
    return {"ssl_context_factory": lambda _config, _default: ctx}
