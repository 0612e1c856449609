"""TLS for the MS links: one ``*_tls_enable`` flag and one ``*_tls_items`` object per link.

Items (spec §4.2/§4.3): ``ca_cert``, ``tls_cert``, ``tls_key``, ``tls_passwd``, the master-key
files (``kmcKsfMaster``/``kmcKsfStandby`` in the coordinator, ``kmc_ksf_master``/``kmc_ksf_standby``
in the controller; either spelling is taken) and ``tls_crl`` (empty: no revocation check).
``tls_passwd`` names a file holding the key's password encrypted under those master-key files
(:mod:`mindie_host.keystore`; plain text is read with a warning). Relative paths start at the config
file's directory (``MIES_INSTALL_PATH`` when set).

A listening side (coordinator management and user ports, controller HTTP server) builds its
context with the server's :func:`~mindie_host.server.tls.build_ssl_context` (RSA keys of at
least 3072 bits, client certificates required when ``ca_cert`` is set, CRL checked when given).
A calling side (coordinator to servers, controller to servers and coordinator) verifies the
peer against ``ca_cert`` and shows ``tls_cert``/``tls_key`` as its client certificate.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from ..keystore import SecretReader
from ..server.tls import TLSConfigError, build_ssl_context, check_tls_file_modes, read_password, resolve
from .schema import ConfigError, Section

ITEM_KEYS = ("ca_cert", "tls_cert", "tls_key", "tls_passwd", "tls_crl")
KMC_KEYS = ("kmcKsfMaster", "kmcKsfStandby", "kmc_ksf_master", "kmc_ksf_standby")


@dataclass(frozen=True)
class TLSLink:
    """One link's TLS setting; ``enabled`` False means plain HTTP."""

    name: str
    enabled: bool
    base: Path
    ca_cert: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_passwd: str = ""
    tls_crl: str = ""
    kmc_master: str = ""
    kmc_standby: str = ""

    def _path(self, value: str) -> Path | None:
        return resolve(self.base, value) if value else None

    def secrets(self) -> SecretReader:
        """Decrypts this link's key password under its master-key files."""
        return SecretReader(self._path(self.kmc_master), self._path(self.kmc_standby), f"{self.name}_tls_items")

    def password(self) -> str | None:
        """The private key's password from ``tls_passwd`` (decrypted), or None."""
        return read_password(self._path(self.tls_passwd), self.secrets())

    def server_context(self) -> ssl.SSLContext | None:
        """The context for a listener on this link, or None when TLS is off."""
        if not self.enabled:
            return None
        cert, key = self._path(self.tls_cert), self._path(self.tls_key)
        if cert is None or key is None:
            raise TLSConfigError(f"{self.name}: tls_cert and tls_key are required when TLS is enabled")
        ca = self._path(self.ca_cert)
        crl = self._path(self.tls_crl)
        return build_ssl_context(cert, key, self._path(self.tls_passwd), [ca] if ca else [], [crl] if crl else [],
                                 what=self.name, secrets=self.secrets())

    def client_context(self) -> ssl.SSLContext | bool:
        """What httpx takes as ``verify`` for calls on this link (False-free: plain HTTP uses True)."""
        if not self.enabled:
            return True
        ca = self._path(self.ca_cert)
        if ca is not None and not ca.is_file():
            raise TLSConfigError(f"{self.name}: CA file {ca} does not exist")
        check_tls_file_modes([ca, self._path(self.tls_cert), self._path(self.tls_key), self._path(self.tls_passwd),
                              self._path(self.tls_crl)], self.name)
        ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        cert, key = self._path(self.tls_cert), self._path(self.tls_key)
        if cert is not None and key is not None:
            for path in (cert, key):
                if not path.is_file():
                    raise TLSConfigError(f"{self.name}: {path} does not exist")
            try:
                ctx.load_cert_chain(str(cert), str(key), password=self.password())
            except ssl.SSLError as exc:
                raise TLSConfigError(f"{self.name}: cannot load {cert} with {key}: {exc}") from exc
        crl = self._path(self.tls_crl)
        if crl is not None and crl.is_file():
            ctx.load_verify_locations(cafile=str(crl))
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
        return ctx

    @property
    def scheme(self) -> str:
        return "https" if self.enabled else "http"


def tls_base(config_path: str | None) -> Path:
    """Where relative certificate paths start."""
    install = os.environ.get("MIES_INSTALL_PATH")
    if install:
        return Path(install)
    return Path(config_path).resolve().parent if config_path else Path.cwd()


def read_link(tls: Section, link: str, base: Path, *, enable_key: str = "", items_key: str = "",
              enabled: bool | None = None) -> TLSLink:
    """``{link}_tls_enable`` and, when enabled, ``{link}_tls_items`` from ``tls_config``.

    ``enable_key``/``items_key`` name the two keys where a file spells them otherwise; ``enabled`` given
    means the link has no switch (its items are required).
    """
    if enabled is None:
        enabled = tls.boolean(enable_key or f"{link}_tls_enable")
    items_key = items_key or f"{link}_tls_items"
    if not enabled:
        tls.raw(items_key, required=False)
        return TLSLink(link, False, base)
    items = tls.section(items_key)
    values = {}
    for key in ITEM_KEYS:
        value = items.raw(key, required=key in ("tls_cert", "tls_key"), default="")
        if not isinstance(value, str):
            raise ConfigError(items.key(key), value, "a file path string")
        values[key] = value
    kmc = {}
    for key in KMC_KEYS:
        value = items.raw(key, required=False, default="")
        if not isinstance(value, str):
            raise ConfigError(items.key(key), value, "a file path string")
        if value:
            kmc["kmc_master" if key in ("kmcKsfMaster", "kmc_ksf_master") else "kmc_standby"] = value
    items.finish()
    return TLSLink(link, True, base, **values, **kmc)
