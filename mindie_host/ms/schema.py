"""Reading MindIE MS JSON config files: typed keys with ranges and errors that name the key.

MS config files (``ms_coordinator.json``, ``ms_controller.json``) require every key. A
missing key, a wrong type or a value out of range raises :class:`~mindie_host.config.ConfigError`
with the dotted key, the value given and what is allowed, the same as ``config.json``. Unknown
keys are collected as warnings. Several coordinator keys are numbers written as JSON strings
(``"predict_port": "1025"``, ``"cache_size": "100"``); :meth:`Section.str_int` and
:meth:`Section.str_float` read those (a bare number is accepted too).
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Mapping
from typing import Any

from ..config import ConfigError, check_file_mode, read_json

__all__ = ["ConfigError", "Section", "read_json_file"]


def read_json_file(path: str, environ: Mapping[str, str] | None = None) -> Any:
    """A JSON file, with the same file-level errors as ``config.json`` (size, UTF-8, syntax, mode at most 0640 unless
    ``MINDIE_CHECK_INPUTFILES_PERMISSION=0`` in ``environ``, default the process's)."""
    check_file_mode(path, os.environ if environ is None else environ)
    return read_json(path)


class Section:
    """One JSON object of a config file, read key by key; ``path`` is its dotted location."""

    def __init__(self, data: Any, path: str, warnings: list[str]) -> None:
        if not isinstance(data, dict):
            raise ConfigError(path or "(file)", data if not isinstance(data, (list, dict)) else type(data).__name__,
                              "a JSON object")
        self.data = data
        self.path = path
        self.warnings = warnings
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        """The dotted name of ``name`` in this section."""
        return f"{self.path}.{name}" if self.path else name

    def raw(self, name: str, *, required: bool = True, default: Any = None) -> Any:
        self.seen.add(name)
        if name not in self.data:
            if required:
                raise ConfigError(self.key(name), None, "a value: the key is required")
            return default
        return self.data[name]

    def section(self, name: str, *, required: bool = True) -> Section:
        """A nested object."""
        value = self.raw(name, required=required, default={})
        return Section(value, self.key(name), self.warnings)

    def boolean(self, name: str, **kw: Any) -> bool:
        value = self.raw(name, **kw)
        if not isinstance(value, bool):
            raise ConfigError(self.key(name), value, "true or false")
        return value

    def integer(self, name: str, lo: int, hi: int, **kw: Any) -> int:
        value = self.raw(name, **kw)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(self.key(name), value, f"an integer in [{lo}, {hi}]")
        return value

    def string(self, name: str, *, choices: tuple[str, ...] = (), max_len: int = 4096, **kw: Any) -> str:
        value = self.raw(name, **kw)
        if choices:
            if value not in choices:
                raise ConfigError(self.key(name), value, "one of " + ", ".join(repr(c) for c in choices))
        elif not isinstance(value, str) or len(value) > max_len:
            raise ConfigError(self.key(name), value, f"a string of at most {max_len} characters")
        return value

    def ip(self, name: str, **kw: Any) -> str:
        value = self.raw(name, **kw)
        try:
            ipaddress.IPv4Address(value)
        except (ipaddress.AddressValueError, ValueError, TypeError):
            raise ConfigError(self.key(name), value, "an IPv4 address such as '127.0.0.1'") from None
        return str(value)

    def str_int(self, name: str, lo: int, hi: int, **kw: Any) -> int:
        """An integer written as a string (``"1025"``); a bare integer is accepted too."""
        value = self.raw(name, **kw)
        allowed = f"an integer in [{lo}, {hi}] as a string such as \"{lo}\""
        if isinstance(value, str) and value.strip().isdigit():
            number = int(value.strip())
        elif isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            raise ConfigError(self.key(name), value, allowed)
        if not lo <= number <= hi:
            raise ConfigError(self.key(name), value, allowed)
        return number

    def str_float(self, name: str, lo: float, hi: float, **kw: Any) -> float:
        """A number written as a string (``"0.05"``); a bare number is accepted too."""
        value = self.raw(name, **kw)
        allowed = f"a number in [{lo}, {hi}] as a string such as \"{lo}\""
        try:
            number = float(value) if isinstance(value, (str, int, float)) and not isinstance(value, bool) else None
        except ValueError:
            number = None
        if number is None or math.isnan(number) or not lo <= number <= hi:
            raise ConfigError(self.key(name), value, allowed)
        return number

    def finish(self) -> None:
        """Warn about keys this section does not know."""
        for name in self.data:
            if name not in self.seen:
                self.warnings.append(f"{self.key(name)}: unknown key, ignored")
