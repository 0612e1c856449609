"""``mindie-host config upgrade``: MindIE's config compatibility tool (spec §8.4.4).

An old ``config.json`` is upgraded to a later version, forward only: the target must be later
than the file's version (no rollback, no same-version run), at most three versions on, which
covers every pair of the four versions the tool knows:

========  ==============
version   MindIE release
========  ==============
0.1.0     1.0.RC1
0.2.0     1.0.RC2
1.0.0     1.0.RC3
1.1.0     1.0.0 (the default target; the layout this host reads)
========  ==============

Each step applies the rules the spec gives for it. The spec gives one: 1.0.RC1's ``pipelineNumber``
was removed and ``BackendConfig.modelInstanceNumber`` (the number of model instances) took its
place, so 0.1.0 -> 0.2.0 moves the value there (a file that sets both, differently, is refused:
the operator must say which holds). The spec lists no other renamed key, so the later steps carry
the values over unchanged. Keys are never added: a key the old file left out keeps meaning its
default. The result is then checked by this host's config loader, and a key the loader does not
know is a conversion error naming it, as the spec's tool fails on "field names that differ from
the version's own". Nothing is written unless the whole result is valid.

The source version is read from the file: a file with ``pipelineNumber`` is 0.1.0, any other is
taken as 1.1.0 (``Version`` cannot tell, the spec fixes it at "1.0.0" in every release).
``--old_version`` (an extension, as MindIE's later tool has) names it instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConfigError, config_from_dict, read_json
from ..file_modes import write_file

log = logging.getLogger("mindie_host.tools.config_upgrade")

#: (tool version, MindIE release), oldest first
VERSIONS: tuple[tuple[str, str], ...] = (
    ("0.1.0", "1.0.RC1"),
    ("0.2.0", "1.0.RC2"),
    ("1.0.0", "1.0.RC3"),
    ("1.1.0", "1.0.0"),
)
LATEST = VERSIONS[-1][0]
ORDER = [v for v, _ in VERSIONS]
MAX_STEPS = 3
INSTANCES_RANGE = (1, 10)  # BackendConfig.modelInstanceNumber


class UpgradeError(ValueError):
    """The file cannot be upgraded as asked; the message names the key, the version or the rule."""


@dataclass
class Upgrade:
    """An upgraded config and what was done to it."""

    source: str
    target: str
    data: dict[str, Any]
    changes: list[str] = field(default_factory=list)


def release(version: str) -> str:
    """``"0.1.0"`` -> ``"0.1.0 (1.0.RC1)"``."""
    return f"{version} ({dict(VERSIONS)[version]})"


def _find(data: Any, key: str, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every object holding ``key``, with its dotted path, anywhere in ``data``."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(data, dict):
        if key in data:
            found.append((path, data))
        for name, value in data.items():
            found.extend(_find(value, key, f"{path}.{name}" if path else name))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found.extend(_find(value, key, f"{path}[{i}]"))
    return found


def detect_version(data: dict[str, Any]) -> str:
    """The file's version: 0.1.0 when it has 1.0.RC1's ``pipelineNumber``, else the latest."""
    return ORDER[0] if _find(data, "pipelineNumber") else LATEST


def _pipeline_number(data: dict[str, Any], changes: list[str]) -> None:
    """0.1.0 -> 0.2.0: ``pipelineNumber`` becomes ``BackendConfig.modelInstanceNumber``."""
    holders = _find(data, "pipelineNumber")
    if not holders:
        return
    lo, hi = INSTANCES_RANGE
    values = {}
    for path, obj in holders:
        value = obj["pipelineNumber"]
        where = f"{path}.pipelineNumber" if path else "pipelineNumber"
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise UpgradeError(
                f"{where}: got {value!r}; allowed an integer in [{lo}, {hi}] (it becomes "
                "BackendConfig.modelInstanceNumber)"
            )
        values[where] = value
    if len(set(values.values())) > 1:
        raise UpgradeError(f"pipelineNumber is set more than once, differently ({values}); keep one")
    value = next(iter(values.values()))
    backend = data.setdefault("BackendConfig", {})
    if not isinstance(backend, dict):
        raise UpgradeError(f"BackendConfig: got {backend!r}; allowed a JSON object")
    present = backend.get("modelInstanceNumber")
    if present is not None and present != value:
        raise UpgradeError(
            f"BackendConfig.modelInstanceNumber is {present!r} but pipelineNumber is {value}: 1.0.RC1's "
            "pipelineNumber is the number of model instances; remove one or make them agree"
        )
    for _, obj in holders:
        del obj["pipelineNumber"]
    backend["modelInstanceNumber"] = value
    changes.append(f"{', '.join(values)} ({value}) -> BackendConfig.modelInstanceNumber")


#: the rules of each step, keyed by the version the step starts from
STEPS: dict[str, Callable[[dict[str, Any], list[str]], None]] = {
    "0.1.0": _pipeline_number,
    "0.2.0": lambda data, changes: None,  # the spec names no renamed key from 1.0.RC2 to 1.0.RC3
    "1.0.0": lambda data, changes: None,  # nor from 1.0.RC3 to 1.0.0
}


def upgrade(data: Any, target: str = LATEST, source: str | None = None) -> Upgrade:
    """Upgrade parsed ``config.json`` data to ``target``; :class:`UpgradeError` when it cannot be done."""
    if not isinstance(data, dict):
        raise UpgradeError(f"the config must be a JSON object, got {type(data).__name__}")
    known = ", ".join(ORDER)
    for name, value in (("--target_version", target), ("--old_version", source)):
        if value is not None and value not in ORDER:
            raise UpgradeError(f"{name}: got {value!r}; allowed one of {known}")
    detected = detect_version(data)
    if source is None:
        source = detected
    elif detected == ORDER[0] and source != ORDER[0]:
        raise UpgradeError(
            f"--old_version is {source} but the file has pipelineNumber, which only 1.0.RC1 (0.1.0) configs have"
        )
    start, end = ORDER.index(source), ORDER.index(target)
    if end <= start:
        why = "the same version" if end == start else "an earlier version (no rollback)"
        raise UpgradeError(
            f"the file is version {release(source)} and --target_version {release(target)} is {why}: "
            "the tool only upgrades to a later version"
        )
    if end - start > MAX_STEPS:
        raise UpgradeError(f"{release(source)} is more than {MAX_STEPS} versions before {release(target)}")
    result = Upgrade(source, target, copy.deepcopy(data))
    for version in ORDER[start:end]:
        STEPS[version](result.data, result.changes)
    loader_log = logging.getLogger("mindie_host.config")
    level = loader_log.level
    loader_log.setLevel(logging.ERROR)  # its "unknown key ... ignored" would contradict the refusal below
    try:
        cfg = config_from_dict(result.data)
    except ConfigError as exc:
        raise UpgradeError(f"the upgraded config is not valid: {exc}") from None
    finally:
        loader_log.setLevel(level)
    unknown = [
        m.group(1) if (m := re.search(r"unknown key (\S+)", w)) else w for w in cfg.warnings if "unknown key" in w
    ]
    if unknown:
        raise UpgradeError(
            f"the config has keys that version {release(target)} does not have: {', '.join(unknown)} "
            "(rename or remove them; see docs/operating.md)"
        )
    return result


def add_upgrade_parser(config_sub: Any) -> None:
    """``mindie-host config upgrade`` with the spec's options."""
    up = config_sub.add_parser("upgrade", help="upgrade an older MindIE config.json to a later version (spec §8.4.4)")
    up.add_argument("--old_config_path", required=True, help="the config.json to upgrade")
    up.add_argument("--new_config_path", help="where to write the result (default: ./<timestamp>.json)")
    up.add_argument(
        "--target_version",
        default=LATEST,
        choices=ORDER[1:],
        help=f"version to upgrade to (default {LATEST}: " + ", ".join(f"{v}={r}" for v, r in VERSIONS) + ")",
    )
    up.add_argument("--old_version", choices=ORDER, help="the old file's version, when it cannot be told from the file")
    up.add_argument("--enable_log", action="store_true", help="log each step and change to stderr")
    up.add_argument("--force", action="store_true", help="overwrite --new_config_path if it exists")


def cmd_upgrade(args: argparse.Namespace) -> int:
    """Run ``config upgrade``: 0 when the upgraded file was written, 1 otherwise (the reason on stderr)."""
    if args.enable_log:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    old = Path(args.old_config_path)
    new = Path(args.new_config_path) if args.new_config_path else Path.cwd() / f"{time.strftime('%Y%m%d%H%M%S')}.json"
    try:
        data = read_json(str(old))
        result = upgrade(data, args.target_version, args.old_version)
        if new.resolve() == old.resolve():
            raise UpgradeError("--new_config_path is the old file; write the result elsewhere and keep the old one")
        write_file(new, json.dumps(result.data, indent=4, ensure_ascii=False) + "\n", 0o640, replace=args.force)
    except (ConfigError, UpgradeError) as exc:
        print(f"mindie-host config upgrade: {exc}", file=sys.stderr)
        return 1
    except FileExistsError:
        print(f"mindie-host config upgrade: {new} exists (use --force to overwrite)", file=sys.stderr)
        return 1
    log.info("read %s as version %s", old, release(result.source))
    for change in result.changes:
        log.info("changed: %s", change)
    log.info("checked by the config loader: valid")
    print(
        f"wrote {new}: {old} upgraded from {release(result.source)} to {release(result.target)}"
        + (f" ({'; '.join(result.changes)})" if result.changes else " (no key changed)")
    )
    return 0
