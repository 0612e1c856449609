"""The rule language of ``config.json``: one :class:`Rule` per key, and the record of what failed.

A :class:`Rule` holds a key's type, its range or choices, and the text an error shows as
"allowed"; it sits in the metadata of the dataclass field that maps to the key (see
:mod:`.schema`), put there by :func:`json_key`. :class:`Findings` collects what a read of a
file found wrong: every problem is a :class:`ConfigError` naming the dotted key, the value given
and the allowed range; a rule between two keys (:mod:`.checks`) is skipped when a key it reads
already failed.
"""

from __future__ import annotations

import copy
import ipaddress
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: The one logger of the config package (``mindie_host.config``: the CLI and the tests read it by name).
logger = logging.getLogger(__package__)

PATH_MAX = 4096
INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1


class ConfigError(ValueError):
    """A config value has the wrong type, is out of range, or breaks a rule between keys.

    ``key`` is the dotted path of the offending key (for example
    ``BackendConfig.ScheduleConfig.maxBatchSize``, or ``...ModelConfig[0].modelName``),
    ``value`` the value given and ``allowed`` a human description of what is accepted.
    File-level problems use the file name (and line) as ``key``.
    """

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"{key}: got {value!r}; allowed {allowed}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.key, self.value, self.allowed))


def _fmt(x: float | None) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Rule:
    """Type and range of one JSON key.

    kinds: ``bool``, ``int``, ``num`` (int or float, stored as float), ``str``,
    ``ipv4``, ``names`` (list of strings), ``ids`` (list of lists of device ids),
    ``plugins`` (object of objects).
    """

    kind: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    special: tuple[Any, ...] = ()  # values accepted outside [lo, hi] (npuMemSize -1)
    choices: tuple[str, ...] = ()
    nocase: bool = False
    pattern: re.Pattern[str] | None = None
    min_len: int = 0
    max_len: int | None = None
    max_items: int | None = None
    nullable: bool = False
    secret: bool = False  # never echo the value in messages
    text: str | None = None  # overrides the generated "allowed" text
    required_when: str | None = None  # gate name: value must be non-empty when the gate holds
    validator: Callable[[Any], bool] | None = None

    @property
    def meta(self) -> dict[str, Rule]:
        """Dataclass field metadata carrying this rule."""
        return {"rule": self}

    def interval(self) -> str:
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        return f"{left}{_fmt(self.lo)}, {_fmt(self.hi)}{right}"

    def describe(self) -> str:
        if self.text is not None:
            desc = self.text
        elif self.kind == "bool":
            desc = "true or false"
        elif self.kind in ("int", "num"):
            noun = "an integer" if self.kind == "int" else "a number"
            desc = f"{noun} in {self.interval()}"
            if self.special:
                desc = " or ".join(repr(s) for s in self.special) + f" or {desc}"
        elif self.kind == "str" and self.choices:
            desc = "one of " + ", ".join(repr(c) for c in self.choices)
            if self.nocase:
                desc += " (case-insensitive)"
        elif self.kind == "str":
            desc = f"a string of length [{self.min_len}, {self.max_len}]" if self.max_len else "a string"
        elif self.kind == "ipv4":
            desc = "an IPv4 address such as '127.0.0.1'"
        elif self.kind == "names":
            most = f"at most {self.max_items}" if self.max_items else "any number of"
            desc = f"a list of {most} file names, each a string of length [1, {self.max_len}]"
        elif self.kind == "ids":
            desc = "a non-empty list of non-empty lists of device ids (integers >= 0)"
        else:  # plugins
            desc = "a JSON object mapping plugin names to JSON objects"
        return f"null or {desc}" if self.nullable else desc

    def describe_required(self) -> str:
        """What a ``required_when`` key accepts while its gate holds."""
        if self.kind == "names":
            most = f"1 to {self.max_items}" if self.max_items else "at least 1"
            return f"a list of {most} file names, each a string of length [1, {self.max_len}]"
        return f"a non-empty string of length [1, {self.max_len}]"

    def fail(self, key: str, value: Any, allowed: str | None = None) -> ConfigError:
        shown = "<hidden>" if self.secret else value
        return ConfigError(key, shown, allowed or self.describe())

    def check(self, value: Any, key: str) -> Any:
        """Return the value to store, or raise :class:`ConfigError`."""
        if value is None and self.nullable:
            return None
        if not self._type_ok(value):
            raise self.fail(key, value)
        if self.kind in ("int", "num"):
            if value not in self.special and (self.lo is None or not self._in_range(value)):
                raise self.fail(key, value)
            if self.kind == "num":
                value = float(value)
        elif self.kind == "str":
            if self.choices:
                ok = value.lower() in (c.lower() for c in self.choices) if self.nocase else value in self.choices
                if not ok:
                    raise self.fail(key, value)
            if len(value) < self.min_len or (self.max_len is not None and len(value) > self.max_len):
                raise self.fail(key, value)
            if value and self.pattern is not None and not self.pattern.fullmatch(value):
                raise self.fail(key, value)
        elif self.kind == "ipv4":
            try:
                ipaddress.IPv4Address(value)
            except ValueError:
                raise self.fail(key, value) from None
        elif self.kind == "names":
            if self.max_items is not None and len(value) > self.max_items:
                raise self.fail(key, value)
            if any(not n or (self.max_len is not None and len(n) > self.max_len) for n in value):
                raise self.fail(key, value)
        elif self.kind == "ids":
            if not value or any(not ids or any(not _is_int(i) or i < 0 for i in ids) for ids in value):
                raise self.fail(key, value)
        elif self.kind == "plugins":
            for name, section in value.items():
                if not isinstance(section, dict):
                    raise ConfigError(f"{key}.{name}", section, "a JSON object (this plugin's settings)")
        if self.validator is not None and not self.validator(value):
            raise self.fail(key, value)
        return copy.deepcopy(value)

    def _type_ok(self, v: Any) -> bool:
        if self.kind == "bool":
            return isinstance(v, bool)
        if self.kind == "int":
            return _is_int(v)
        if self.kind == "num":
            return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)
        if self.kind in ("str", "ipv4"):
            return isinstance(v, str)
        if self.kind == "names":
            return isinstance(v, list) and all(isinstance(n, str) for n in v)
        if self.kind == "ids":
            return isinstance(v, list) and all(isinstance(ids, list) for ids in v)
        return isinstance(v, dict) and all(isinstance(k, str) for k in v)  # plugins

    def _in_range(self, v: float) -> bool:
        lo, hi = self.lo, self.hi
        if lo is not None and (v <= lo if self.lo_open else v < lo):
            return False
        return not (hi is not None and (v >= hi if self.hi_open else v > hi))


def int_range(lo: int, hi: int, **kw: Any) -> Rule:
    """An integer in [lo, hi] (``lo_open``/``hi_open`` make an end open)."""
    return Rule("int", lo=lo, hi=hi, **kw)


def num_range(lo: float, hi: float, **kw: Any) -> Rule:
    """A finite number in [lo, hi], stored as a float."""
    return Rule("num", lo=lo, hi=hi, **kw)


BOOL = Rule("bool")
PORT = int_range(1024, 65535)
IPV4 = Rule("ipv4")


def one_of(*choices: str, nocase: bool = False) -> Rule:
    """One of the given strings."""
    return Rule("str", choices=choices, nocase=nocase)


def int_one_of(*choices: int) -> Rule:
    """One of the given integers."""
    return Rule("int", special=choices, text="one of " + ", ".join(map(str, choices)))


def path_rule(required_when: str | None = None) -> Rule:
    """A file or directory path: at most PATH_MAX characters, non-empty when its gate holds."""
    return Rule("str", max_len=PATH_MAX, required_when=required_when)


def json_key(default: Any, rule: Rule) -> Any:
    """A dataclass field for one JSON key with an immutable default (lists use :func:`files_key`)."""
    return field(default=default, metadata=rule.meta)


def files_key(*default: str, required_when: str | None = None, max_items: int | None = 3) -> Any:
    """A dataclass field for a list of certificate / CRL file names, ``default`` its names."""
    rule = Rule("names", max_len=PATH_MAX, max_items=max_items, required_when=required_when)
    return field(default_factory=lambda: list(default), metadata=rule.meta)


class Findings:
    """What reading one config found: errors (each names its key) and warnings (unknown keys ...)."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []
        self.warnings: list[str] = []
        self.bad: set[str] = set()

    def error(self, err: ConfigError) -> None:
        """Record an error; rules that read its key are skipped from now on."""
        self.errors.append(err)
        self.bad.add(err.key)

    def need(self, ok: bool, key: str, value: Any, allowed: str, *reads: str) -> None:
        """Record an error for ``key`` unless ``ok``, or unless it or a key in ``reads`` already failed."""
        if not ok and key not in self.bad and not any(r in self.bad for r in reads):
            self.error(ConfigError(key, value, allowed))

    def warn(self, message: str) -> None:
        """Record and log a warning."""
        self.warnings.append(message)
        logger.warning("%s", message)
