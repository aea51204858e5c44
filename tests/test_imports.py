"""kvforge's modules import each other without circles, and never load their own modules by name.

Read from the source (``ast``), nothing is imported: a module's imports are the ``import`` / ``from ... import``
statements outside ``if TYPE_CHECKING:``; "module level" leaves out those inside functions and classes (deferred
imports). A package importing its own submodules, or a submodule its package, is how packages work and is not a
circle. Run as a script to print the circles: ``python tests/test_imports.py``.
"""

from __future__ import annotations

import ast
import itertools
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kvforge"

# Circles closed only by a deferred import inside a function, and the modules of each. They work (the deferred
# import runs after both modules are loaded) but tie the modules together; a new one fails the test.
KNOWN_DEFERRED: list[set[str]] = []


def modules(root: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def import_graph(mods: dict[str, Path], deferred: bool) -> dict[str, set[str]]:
    """module -> the kvforge modules it imports (``deferred``: also inside functions and classes)."""

    def resolve(name: str) -> str | None:  # the longest known module prefix of an imported name
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
        return None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

        def visit(node: ast.AST, top: bool, mod: str = mod, package: str = package) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)) and (top or deferred):
                    if isinstance(child, ast.Import):
                        names = [a.name for a in child.names]
                    else:
                        base = child.module or ""
                        if child.level:  # relative: from the package, one level up per dot after the first
                            parts = package.split(".")
                            base = ".".join([*parts[: len(parts) - child.level + 1], *([base] if base else [])])
                        names = [base] + [f"{base}.{a.name}" for a in child.names]
                    for n in names:
                        target = resolve(n)
                        if (
                            target
                            and target != mod
                            and not mod.startswith(target + ".")
                            and not target.startswith(mod + ".")
                        ):
                            graph[mod].add(target)
                inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))
                visit(child, top and not inner)

        visit(ast.parse(path.read_text()), True)
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    counter = itertools.count()

    def strong(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_circle_at_module_level():
    assert circles(import_graph(modules(), deferred=False)) == []


def test_deferred_imports_close_no_new_circle():
    found = circles(import_graph(modules(), deferred=True))
    new = [sorted(c) for c in found if not any(c <= known for known in KNOWN_DEFERRED)]
    assert new == [], f"a deferred import closes a new import circle: {new}"


def test_the_graph_sees_a_circle():
    """The check itself: two modules importing each other (one of them in a function) are found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert circles(graph) == [{"a", "b"}]
    mods = modules()
    assert len(mods) > 50 and "kvforge.engine" in import_graph(mods, deferred=False)["kvforge.serve.scheduler"]


def test_no_module_of_ours_is_loaded_by_name():
    """``importlib.import_module`` / ``__import__`` hide imports from readers and from the checks above."""
    offenders = []
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                called = ast.unparse(node.func)
                if called.endswith("import_module") or called == "__import__":
                    offenders.append(f"{mod}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


if __name__ == "__main__":
    for label, deferred in (("module level", False), ("with deferred imports", True)):
        print(label, [sorted(c) for c in circles(import_graph(modules(), deferred))])
