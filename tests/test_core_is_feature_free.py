"""The engine and the backends know no feature: LoRA, prefix caching and the like live in plugins.

Per-request model variants reach the core only through the generic seam (``EngineRequest.variant``,
``ModelInput.row_variants``, ``LinearDeltas`` / ``mindie_host_linear_deltas``); block sharing only through
the KV manager hook. This test keeps it that way.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

CORE = [Path(__file__).resolve().parents[1] / "mindie_host" / part for part in ("engine", "backends")]
FEATURE_WORDS = re.compile(r"lora|adapter|prefix_?cach", re.IGNORECASE)


def identifiers(path: Path) -> set[str]:
    """Every name, attribute, argument, function and class identifier in ``path``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.keyword) and node.arg:
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name)
    return names


def test_no_feature_identifier_in_the_engine_or_the_backends() -> None:
    found = {
        f"{path.relative_to(CORE[0].parents[1])}: {name}"
        for root in CORE
        for path in sorted(root.rglob("*.py"))
        for name in identifiers(path)
        if FEATURE_WORDS.search(name)
    }
    assert not found, "feature names in the core: " + ", ".join(sorted(found))


def test_no_feature_word_in_the_engine_or_backend_text() -> None:
    """Not even in strings and comments: the core describes the seams, not the plugins that use them."""
    hits = [
        f"{path.relative_to(CORE[0].parents[1])}:{i}: {line.strip()}"
        for root in CORE
        for path in sorted(root.rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"lora|adapter", line, re.IGNORECASE)
    ]
    assert not hits, "\n".join(hits)
