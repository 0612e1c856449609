"""The master key and the secrets encrypted under it: what MindIE keeps in its KMC key stores.

A *keystore* is a pair of files, the primary and the standby, that ``kmcKsfMaster`` and
``kmcKsfStandby`` (``kmc_ksf_master``/``kmc_ksf_standby`` in the MS configs) name. Each holds the
same JSON: the master keys (256 random bits each, with the date it was made and the date it
expires), which one is active, a generation number and a SHA-256 checksum of the rest. Both are
written with mode 0600, the primary first, each replaced atomically. On reading, a primary that
is missing, truncated or fails its checksum is rebuilt from the standby (and the other way
round), with a warning naming the damaged file; when both are damaged the error names both.

A *secret* (a private-key password, an API key) is encrypted with AES-256-GCM under a work key
derived from the active master key (HKDF-SHA256). Its text form is
``MHK1:<key id>:<base64 of nonce, ciphertext and tag>``, one line, safe in a JSON string; the
key id and the format are bound to it as associated data, so a token cannot be moved to another
key or altered unnoticed. Password files (``tlsPkPwd``, ``tls_passwd``) hold such a token;
``apiKey`` may be one inline.

Rotation (:meth:`Keystore.rotate`, MindIE's ``updateMasterKey``) adds a new active key, re-encrypts
the named files under it (a file's tokens are replaced in place, JSON config files included) and
then deletes the old keys: a token left under an old key no longer decrypts, and its error says
so. Erasing (:func:`erase`) overwrites both files with random bytes, then zeros, and removes them.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .file_modes import SECRET_MODE, FileModeError, check_mode, write_file

__all__ = ["TOKEN_PREFIX", "Keystore", "KeystoreError", "SecretReader", "erase", "is_token"]

log = logging.getLogger("mindie_host.keystore")

FORMAT = "mindie-host-keystore"
TOKEN_PREFIX = "MHK1:"
TOKEN_RE = re.compile(r"MHK1:(\d{1,9}):([A-Za-z0-9_-]{38,})")  # 12-byte nonce + 16-byte tag at least
DEFAULT_LIFETIME_DAYS = 365
MAX_AHEAD_DAYS = 1825  # the spec's aheadDays range [0, 1825]
_INFO = b"mindie-host secrets v1"


class KeystoreError(RuntimeError):
    """A keystore or a secret that cannot be used; the message names the file and what to do."""


def is_token(text: str) -> bool:
    """True when ``text`` is an encrypted secret (:data:`TOKEN_PREFIX`)."""
    return text.startswith(TOKEN_PREFIX)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class MasterKey:
    """One master key: ``id``, 32 random bytes, when it was made and when it expires."""

    id: int
    key: bytes
    created: dt.datetime
    expires: dt.datetime

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "key": _b64(self.key),
            "created": self.created.isoformat(),
            "expires": self.expires.isoformat(),
        }

    @classmethod
    def from_json(cls, item: Any) -> MasterKey:
        key = _unb64(item["key"])
        if not isinstance(item["id"], int) or len(key) != 32:
            raise ValueError("a key entry is malformed")
        return cls(
            item["id"], key, dt.datetime.fromisoformat(item["created"]), dt.datetime.fromisoformat(item["expires"])
        )

    def _aead(self) -> Any:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(self.key))


@dataclass
class Keystore:
    """The master keys held in a primary and a standby file (see the module docstring)."""

    primary: Path
    standby: Path
    keys: dict[int, MasterKey] = field(default_factory=dict)
    active: int = 0
    generation: int = 0

    # -- files ------------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        primary: str | os.PathLike[str],
        standby: str | os.PathLike[str],
        *,
        lifetime_days: int = DEFAULT_LIFETIME_DAYS,
    ) -> Keystore:
        """A new keystore with one active key, written to both files; existing files are an error."""
        store = cls(Path(primary), Path(standby))
        for path in (store.primary, store.standby):
            if path.exists():
                raise KeystoreError(f"{path} exists: a keystore is already there (erase it first to start over)")
        store._add_key(lifetime_days)
        store.save()
        return store

    @classmethod
    def load(cls, primary: str | os.PathLike[str], standby: str | os.PathLike[str]) -> Keystore:
        """Read the keystore, repairing a damaged or missing file from the other one."""
        store = cls(Path(primary), Path(standby))
        for path in (store.primary, store.standby):  # a mode problem is the operator's to fix, never "repaired"
            try:
                check_mode(path, SECRET_MODE, "a master-key file")
            except FileModeError as exc:
                raise KeystoreError(str(exc)) from None
        found: dict[Path, dict[str, Any]] = {}
        problems: dict[Path, str] = {}
        for path in (store.primary, store.standby):
            try:
                found[path] = cls._read(path)
            except KeystoreError as exc:
                problems[path] = str(exc)
        if not found:
            raise KeystoreError(
                "no usable master-key file: " + "; ".join(problems.values()) + " (create one with "
                "`mindie-host certs create_keystore`, then encrypt the secrets again)"
            )
        best = max(found.values(), key=lambda body: body["generation"])
        store.generation = best["generation"]
        store.active = best["active"]
        store.keys = {k.id: k for k in map(MasterKey.from_json, best["keys"])}
        if store.active not in store.keys:
            raise KeystoreError(f"{store.primary}: the active key {store.active} is not in the file")
        stale = [p for p in (store.primary, store.standby) if p not in found or found[p] != best]
        for path in stale:
            why = problems.get(path, "an older generation")
            log.warning("master-key file %s: %s; rewriting it from the other file", path, why)
            try:
                store._write(path)
            except OSError as exc:
                log.warning("could not repair %s: %s", path, exc)
        return store

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise KeystoreError(f"{path} does not exist") from None
        except (OSError, ValueError, RecursionError) as exc:
            raise KeystoreError(f"{path} cannot be read ({type(exc).__name__})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise KeystoreError(f"{path} is not a mindie-host keystore")
        body = {k: v for k, v in data.items() if k != "checksum"}
        if data.get("checksum") != _checksum(body):
            raise KeystoreError(f"{path} is damaged (its checksum does not match)")
        try:
            [MasterKey.from_json(item) for item in body["keys"]]
            int(body["active"]), int(body["generation"])
        except (KeyError, TypeError, ValueError) as exc:
            raise KeystoreError(f"{path} is damaged ({exc})") from None
        return body

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": 1,
            "generation": self.generation,
            "active": self.active,
            "keys": [k.to_json() for k in sorted(self.keys.values(), key=lambda k: k.id)],
        }

    def _write(self, path: Path) -> None:
        body = self._body()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_file(path, json.dumps({**body, "checksum": _checksum(body)}, indent=1), SECRET_MODE)

    def save(self) -> None:
        """Write a new generation: the primary first, then the standby."""
        self.generation += 1
        self._write(self.primary)
        self._write(self.standby)

    def _add_key(self, lifetime_days: int) -> MasterKey:
        created = _now()
        key = MasterKey(
            max(self.keys, default=0) + 1, secrets.token_bytes(32), created, created + dt.timedelta(days=lifetime_days)
        )
        self.keys[key.id] = key
        self.active = key.id
        return key

    # -- secrets ----------------------------------------------------------------------------------
    @property
    def active_key(self) -> MasterKey:
        return self.keys[self.active]

    def encrypt(self, plaintext: str) -> str:
        """``plaintext`` as a token under the active key."""
        key = self.active_key
        if key.expires <= _now():
            log.warning(
                "master key %d expired on %s; rotate it (mindie-host certs update_master_key)",
                key.id,
                key.expires.date(),
            )
        nonce = secrets.token_bytes(12)
        sealed = key._aead().encrypt(nonce, plaintext.encode("utf-8"), f"{TOKEN_PREFIX}{key.id}".encode())
        return f"{TOKEN_PREFIX}{key.id}:{_b64(nonce + sealed)}"

    def decrypt(self, token: str, where: str = "the secret") -> str:
        """The plaintext of ``token``; :class:`KeystoreError` names ``where`` and why it cannot be decrypted."""
        match = TOKEN_RE.fullmatch(token.strip())
        if match is None:
            raise KeystoreError(f"{where} is not a well-formed encrypted secret ({TOKEN_PREFIX}<key id>:<data>)")
        key = self.keys.get(int(match.group(1)))
        if key is None:
            raise KeystoreError(
                f"{where} was encrypted under master key {match.group(1)}, which {self.primary} no "
                f"longer holds (it was rotated away or the keystore is another one); encrypt it "
                "again: mindie-host certs encrypt"
            )
        raw = _unb64(match.group(2))
        from cryptography.exceptions import InvalidTag

        try:
            plain = key._aead().decrypt(raw[:12], raw[12:], f"{TOKEN_PREFIX}{key.id}".encode())
        except (InvalidTag, ValueError):
            raise KeystoreError(
                f"{where} does not decrypt under master key {key.id} (altered or made with another keystore)"
            ) from None
        if key.expires <= _now():
            log.warning(
                "%s is under master key %d, which expired on %s; rotate it (mindie-host certs update_master_key)",
                where,
                key.id,
                key.expires.date(),
            )
        return plain.decode("utf-8")

    def rotate(
        self,
        files: Iterable[str | os.PathLike[str]],
        *,
        ahead_days: int = 0,
        force: bool = False,
        lifetime_days: int = DEFAULT_LIFETIME_DAYS,
    ) -> list[Path]:
        """MindIE's ``updateMasterKey``: when the active key expires within ``ahead_days`` (or ``force``), make a new
        active key, re-encrypt every token in ``files`` under it, then delete the old keys. Returns the files
        rewritten, or ``[]`` when the key was not due."""
        if not 0 <= ahead_days <= MAX_AHEAD_DAYS:
            raise KeystoreError(f"aheadDays: got {ahead_days}; allowed an integer in [0, {MAX_AHEAD_DAYS}]")
        if not force and self.active_key.expires > _now() + dt.timedelta(days=ahead_days):
            return []
        paths = [Path(p) for p in files]
        texts = {}
        for path in paths:  # every file must hold tokens that decrypt, and be writable, before anything changes
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise KeystoreError(f"{path} cannot be read: {exc}") from None
            tokens = TOKEN_RE.findall(text)
            if not tokens:
                raise KeystoreError(f"{path} holds no encrypted secret ({TOKEN_PREFIX}...); leave it out")
            for match in TOKEN_RE.finditer(text):
                self.decrypt(match.group(0), str(path))
            if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
                raise KeystoreError(f"{path} cannot be rewritten (no write permission on it or its directory)")
            texts[path] = text
        old = set(self.keys)
        self._add_key(lifetime_days)
        self.save()  # both keys: a crash from here on leaves every file decryptable
        for path, text in texts.items():
            new = TOKEN_RE.sub(lambda m, where=str(path): self.encrypt(self.decrypt(m.group(0), where)), text)
            write_file(path, new, path.stat().st_mode & 0o777)  # the file keeps its mode
        for key_id in old:
            del self.keys[key_id]
        self.save()
        return paths


def erase(primary: str | os.PathLike[str], standby: str | os.PathLike[str]) -> list[Path]:
    """MindIE's ``secureEraseAllKeystore``: overwrite each file with random bytes, then zeros, and remove it."""
    gone = []
    for path in map(Path, (primary, standby)):
        if not path.exists():
            continue
        size = max(path.stat().st_size, 1)
        with open(path, "r+b") as fh:
            for fill in (secrets.token_bytes(size), bytes(size)):
                fh.seek(0)
                fh.write(fill)
                fh.flush()
                os.fsync(fh.fileno())
        path.unlink()
        gone.append(path)
    return gone


class SecretReader:
    """Reads secrets for one component: a token decrypts under the keystore at ``primary``/``standby`` (loaded on
    first use); plain text is taken as it is, with one warning per place that it should be encrypted."""

    def __init__(self, primary: Path | None, standby: Path | None, owner: str) -> None:
        self.primary, self.standby, self.owner = primary, standby, owner
        self._store: Keystore | None = None

    def keystore(self, where: str) -> Keystore:
        if self._store is None:
            if self.primary is None or self.standby is None:
                raise KeystoreError(
                    f"{where} is encrypted, but {self.owner} names no master-key files (kmcKsfMaster and kmcKsfStandby)"
                )
            self._store = Keystore.load(self.primary, self.standby)
        return self._store

    def reveal(self, value: str, where: str) -> str:
        """``value`` decrypted when it is a token, else as it is (with a warning)."""
        if is_token(value):
            return self.keystore(where).decrypt(value, where)
        if value:
            log.warning(
                "%s holds a secret in plain text; encrypt it (mindie-host certs encrypt, docs/operating.md)", where
            )
        return value

    def read_file(self, path: Path | None) -> str | None:
        """The secret in file ``path`` (a key-password file), or None when there is no such file or it is empty."""
        if path is None or not path.is_file():
            return None
        return self.reveal(path.read_text(encoding="utf-8").strip(), str(path)) or None
