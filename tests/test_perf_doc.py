"""Every figure in bench/PERF.md names the script in this tree that made it, and the command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PERF = ROOT / "bench" / "PERF.md"
SCRIPT = re.compile(r"`?((?:bench|plugins/[\w-]+/bench|mindie_host/bench)/[\w./-]+\.(?:py|sh))")
FIGURE = re.compile(r"\d+(?:\.\d+)?\s*(?:ms|µs|s\b|tok/s|x\b|×|%|GB|MB)")
COMMAND = re.compile(r"(?:python|bash|\./)\S*\s+\S*(?:bench|mindie_host)/[\w./-]+|mindie-host bench")


def sections() -> list[tuple[int, str, str]]:
    """(level, title, body) for every ## and ### section."""
    out: list[tuple[int, str, str]] = []
    for block in re.split(r"^(?=#{2,3} )", PERF.read_text(), flags=re.M):
        head, _, body = block.partition("\n")
        if head.startswith("#"):
            out.append((len(head) - len(head.lstrip("#")), head.lstrip("# ").strip(), body))
    return out


def test_every_section_with_figures_names_an_existing_script_and_a_command() -> None:
    problems = []
    parent_scripts: list[str] = []
    parent_command = False
    for level, title, body in sections():
        scripts = SCRIPT.findall(body)
        command = bool(COMMAND.search(body))
        if level == 2:
            parent_scripts, parent_command = scripts, command
        missing = [s for s in scripts if not (ROOT / s).exists()]
        if missing:
            problems.append(f"{title!r} names scripts that are not in the tree: {missing}")
        if FIGURE.search(body):
            if not (scripts or parent_scripts):
                problems.append(f"{title!r} has figures but names no script")
            elif not (command or parent_command):
                problems.append(f"{title!r} has figures but gives no command")
    assert not problems, "\n".join(problems)
