"""The shape of the house: the import graph of every module, its floors, and no circle in it.

The graph is read with ``ast`` from the source of every module under ``mindie_host/`` and of every
plugin package under ``plugins/`` (their tests aside): every ``import`` and ``from ... import``
anywhere in a module counts, type-only ones (``if TYPE_CHECKING:``) and those inside functions
included; relative imports are resolved; ``import a.b`` and ``from a import b`` where ``b`` is a
module both count as importing ``a.b``, and importing ``a.b`` also runs the ``__init__`` of each
package above it (``a``) that does not enclose the importer. Imports by name at run time
(``importlib``, the builtin plugins, entry points) are not edges.

The floors (docs/architecture.md) are listed top to bottom; a module may import its own floor and
those below, never one above. Run this file as a script to print the graph's cycles and every
upward import.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Top to bottom. A module belongs to the floor of the longest prefix that names it.
FLOORS: tuple[tuple[str, ...], ...] = (
    # the launch commands and tools
    (
        "mindie_host.cli",
        "mindie_host.bench",
        "mindie_host.ms",
        "mindie_host.testing",
        "mindie_host.quant.cli",
        "mindie_host.tools",
    ),
    # assembles and launches
    ("mindie_host.runtime",),
    # the request facade
    ("mindie_host.host",),
    # the protocols, structured outputs and the plugin contract, with the public surface and the plugins
    (
        "mindie_host.server",
        "mindie_host.structured",
        "mindie_host.plugins",
        "mindie_host.hookspecs",
        "mindie_host.context",
        "mindie_host.host_protocol",
        "mindie_host.content",
        "mindie_host.chat_template",
        "mindie_host.tool_parsers",
        "mindie_host.reasoning_parsers",
        "mindie_host.api",
        "mindie_host.backend_api",
        "mindie_plugin_",
    ),
    # the serving loop, and PD disaggregation's per-request call and KV transport beside it
    ("mindie_host.engine", "mindie_host.pd"),
    # the model runners and their ranks
    ("mindie_host.backends", "mindie_host.distributed", "mindie_host.quant", "mindie_host.kv_sizing"),
    # what everything reads ("mindie_host": the package's own __init__, not everything in it)
    (
        "mindie_host",
        "mindie_host.config",
        "mindie_host.models",
        "mindie_host.logs",
        "mindie_host.log_env",
        "mindie_host.tokenizer",
        "mindie_host.host_state",
        "mindie_host.client",
        "mindie_host.file_modes",
        "mindie_host.keystore",
    ),
)

#: The launch commands: the only modules that may import ``mindie_host.runtime`` (besides itself).
LAUNCHERS = ("mindie_host.cli", "mindie_host.bench", "mindie_host.ms", "mindie_host.testing")

def module_files() -> dict[str, Path]:
    """Module name -> source file, for the host and each plugin package."""
    packages = [ROOT / "mindie_host", *sorted(ROOT.glob("plugins/*/mindie_plugin_*"))]
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            parts = list(path.relative_to(package.parent).with_suffix("").parts)
            if "tests" in parts:
                continue
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imported_names(module: str, path: Path) -> Iterable[str]:
    """Every dotted name ``module`` imports: ``a.b`` for ``import a.b``, ``a.b`` for ``from a import b``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            yield from (f"{source}.{alias.name}" for alias in node.names)


@cache
def graph() -> dict[str, frozenset[str]]:
    """Module -> the modules it imports (this repository's only)."""
    files = module_files()
    edges: dict[str, frozenset[str]] = {}
    for module, path in files.items():
        targets: set[str] = set()
        for name in imported_names(module, path):
            while name and name not in files:  # `from a import b` where b is a name in a: a itself
                name = name.rpartition(".")[0]
            if not name or name == module:
                continue
            targets.add(name)
            parent = name.rpartition(".")[0]
            while parent:  # the package __init__s above it run too, unless they enclose the importer
                if parent in files and not module.startswith(parent + "."):
                    targets.add(parent)
                parent = parent.rpartition(".")[0]
        edges[module] = frozenset(targets)
    return edges


def cycles(edges: dict[str, frozenset[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def floor(module: str) -> int | None:
    """The floor of ``module`` (0 at the top), from the longest prefix in :data:`FLOORS` that names it."""
    best: tuple[int, int] | None = None
    for level, names in enumerate(FLOORS):
        for name in names:
            prefix = name if name.endswith("_") else name + "."
            match = module == name or (name != "mindie_host" and module.startswith(prefix))
            if match and (best is None or len(name) > best[1]):
                best = (level, len(name))
    return best[0] if best else None


def upward_imports(edges: dict[str, frozenset[str]]) -> list[str]:
    """``a -> b`` for every import of a module on a higher floor than the importer's."""
    placed = {m: f for m in edges if (f := floor(m)) is not None}  # the unplaced fail test_every_module_has_a_floor
    return [
        f"{module} (floor {placed[module]}) -> {target} (floor {placed[target]})"
        for module in sorted(placed)
        for target in sorted(edges[module])
        if target in placed and placed[target] < placed[module]
    ]


def runtime_importers(edges: dict[str, frozenset[str]]) -> list[str]:
    """Modules outside the launch commands (and ``runtime`` itself) that import ``mindie_host.runtime``."""
    return [
        f"{module} -> {target}"
        for module in sorted(edges)
        for target in sorted(edges[module])
        if (target == "mindie_host.runtime" or target.startswith("mindie_host.runtime."))
        and not any(module == p or module.startswith(p + ".") for p in (*LAUNCHERS, "mindie_host.runtime"))
    ]


def test_the_graph_reads_every_kind_of_import() -> None:
    """Type-only, relative and ``from package import module`` imports are all edges."""
    edges = graph()
    assert "mindie_host.host_protocol" in edges["mindie_host.server.openai"]  # under TYPE_CHECKING, relative
    assert "mindie_host.runtime.engine_main" in edges["mindie_host.runtime.engine_client"]  # from .x import name
    assert "mindie_host.engine.ipc" in edges["mindie_host.engine.process_loop"]  # from . import ipc
    assert "mindie_host.structured" in edges["mindie_host.server.tool_calls"]  # the package __init__ that runs
    assert "mindie_host.api" in edges["mindie_plugin_prefix_cache"]  # plugin packages, absolute


def test_every_module_has_a_floor() -> None:
    assert [m for m in graph() if floor(m) is None] == []


def test_no_import_cycle() -> None:
    """No circle anywhere in the graph, type-only imports included."""
    assert [sorted(c) for c in cycles(graph())] == []


def test_nothing_imports_upward() -> None:
    assert upward_imports(graph()) == []


def test_only_the_launch_commands_import_the_runtime() -> None:
    assert runtime_importers(graph()) == []


def test_the_host_protocol_keeps_the_concrete_host_out_of_the_floors_below() -> None:
    """server/, structured/, the plugin contract and the plugins type against host_protocol, never import host.py."""
    edges = graph()
    host_floor = floor("mindie_host.host")
    assert host_floor is not None
    below = [m for m in edges if (f := floor(m)) is not None and f > host_floor]
    assert [m for m in below if "mindie_host.host" in edges[m]] == []


#: What plugins, their tests and the examples may import from the host: the public surface.
PUBLIC = ("mindie_host.api", "mindie_host.backend_api", "mindie_host.testing")
#: The one file allowed over :data:`MAX_LINES` (the binary tensor codec, one table-driven format).
LONG_FILES = {"mindie_host/server/triton_binary.py"}
MAX_LINES = 600
#: engine/core.py keeps the request lifecycle, the loop and sampling (issue 36: about 400 lines)
CORE_MAX_LINES = 420


def private_imports() -> list[str]:
    """``file:line name`` for every import of the host, outside the public surface, by a plugin package, a
    plugin's tests or an example (``from mindie_host import hookimpl`` is the marker, and public too)."""
    found = []
    for path in sorted([*ROOT.glob("plugins/**/*.py"), *ROOT.glob("examples/**/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module == "mindie_host":
                    names = [f"mindie_host.{alias.name}" for alias in node.names if alias.name != "hookimpl"]
                else:
                    names = [node.module]
            else:
                continue
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno} {name}"
                for name in names
                if (name == "mindie_host" or name.startswith("mindie_host.")) and name not in PUBLIC
            ]
    return found


def long_files() -> list[str]:
    """Python files under mindie_host/ and plugins/ (tests aside) over :data:`MAX_LINES` lines."""
    paths = [*ROOT.glob("mindie_host/**/*.py"), *ROOT.glob("plugins/*/mindie_plugin_*/**/*.py")]
    return [
        f"{rel} ({n} lines)"
        for path in sorted(paths)
        if (rel := path.relative_to(ROOT).as_posix()) not in LONG_FILES
        and (n := len(path.read_text().splitlines())) > MAX_LINES
    ]


def hook_signatures_off_contract() -> list[str]:
    """``file:line hook(args)`` for every hook implementation in the tree (the host's builtins, the plugins, the
    examples, the tests' plugins) that does not take ``ctx`` first or names an argument its spec lacks: one
    contract version, and the builtins teach it (docs/plugins.md, 'Migrating to contract 3')."""
    specs = {
        node.name: {a.arg for a in node.args.args}
        for node in ast.parse((ROOT / "mindie_host/hookspecs.py").read_text()).body
        if isinstance(node, ast.FunctionDef)
    }
    paths = [*ROOT.glob("mindie_host/**/*.py"), *ROOT.glob("plugins/**/*.py"), *ROOT.glob("examples/**/*.py"),
             *ROOT.glob("tests/**/*.py")]
    found = []
    for path in sorted(paths):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not node.name.startswith("mindie_host_"):
                continue
            if not any("hookimpl" in ast.unparse(d) for d in node.decorator_list):
                continue
            args = [a.arg for a in node.args.args]
            args = args[1:] if args[:1] == ["self"] else args
            unknown = [a for a in args if node.name in specs and a not in specs[node.name]]
            if args[:1] != ["ctx"] or unknown:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}({', '.join(args)})")
    return found


def test_every_hook_implementation_takes_ctx_first_and_nothing_it_carries() -> None:
    assert hook_signatures_off_contract() == []


def test_every_hook_spec_takes_ctx_first_and_nothing_it_carries() -> None:
    """A hook added later keeps contract 3: ``ctx`` first, no config/model_config/host beside it, and a context
    class of its own (mindie_host.context.HOOK_CONCERNS)."""
    from mindie_host.context import HOOK_CONCERNS
    from mindie_host.plugins import V2_ARGUMENTS

    specs = [node for node in ast.parse((ROOT / "mindie_host/hookspecs.py").read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("mindie_host_")]
    off = [f"{node.name}({', '.join(a.arg for a in node.args.args)})" for node in specs
           if [a.arg for a in node.args.args][:1] != ["ctx"] or {a.arg for a in node.args.args} & set(V2_ARGUMENTS)]
    assert off == []
    assert sorted(node.name for node in specs) == sorted(HOOK_CONCERNS)


def test_plugins_their_tests_and_the_examples_import_only_the_public_surface() -> None:
    assert private_imports() == []


def test_no_file_does_two_jobs_by_length() -> None:
    """No module over 600 lines (the binary tensor codec aside); the engine core stays near 400."""
    assert long_files() == []
    core = len((ROOT / "mindie_host/engine/core.py").read_text().splitlines())
    assert core <= CORE_MAX_LINES, f"engine/core.py has {core} lines"


if __name__ == "__main__":
    g = graph()
    for c in cycles(g):
        print("cycle:", " ".join(sorted(c)))
    for line in upward_imports(g):
        print("upward:", line)
    for line in runtime_importers(g):
        print("runtime from below:", line)
    for line in private_imports():
        print("private import:", line)
    for line in long_files():
        print("long file:", line)
    for line in hook_signatures_off_contract():
        print("hook off contract 3:", line)
