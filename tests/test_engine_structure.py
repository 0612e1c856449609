"""The engine's four nouns stay apart: the loop (core) uses the scheduler, the output processor and the PD handoff;
none of those imports the loop, the handoff imports none of them, and no engine module reaches into another object's
private attributes. Imports under ``TYPE_CHECKING`` count."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "mindie_host" / "engine"
LOOP = ("core", "scheduler", "outputs", "handoff")


def engine_imports(name: str) -> set[str]:
    """The sibling modules ``engine/<name>.py`` imports, at run time or for type checking."""
    found = set()
    for node in ast.walk(ast.parse((ENGINE / f"{name}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_the_loop_is_imported_by_none_of_its_parts() -> None:
    assert {"scheduler", "outputs", "handoff"} <= engine_imports("core")
    for part in ("scheduler", "outputs", "handoff"):
        assert "core" not in engine_imports(part), f"engine/{part}.py imports the engine loop"
    assert not engine_imports("handoff") & set(LOOP), "the handoff imports the engine's parts"


def test_no_sibling_import_cycle_among_the_engine_step_modules() -> None:
    names = {path.stem for path in ENGINE.glob("*.py")}
    graph = {name: engine_imports(name) & names for name in names}
    seen: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(name: str, path: list[str]) -> None:
        seen[name] = 1
        for dep in sorted(graph[name]):
            assert seen.get(dep) != 1, "import cycle: " + " -> ".join([*path, name, dep])
            if dep not in seen:
                visit(dep, [*path, name])
        seen[name] = 2

    for name in LOOP:
        if name not in seen:
            visit(name, [])


def test_no_engine_module_touches_another_objects_private_attributes() -> None:
    hits = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "os"))  # os._exit
            ):
                hits.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not hits, "\n".join(hits)
