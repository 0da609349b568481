"""The package lines of docs/architecture.md, checked on the source: who may import whom, that no package's imports
go round in a circle, that no module imports another module's private names, what the floors above the engine core
may touch, and the function-length limits (files are split by concept, never by count; the engine core's own import
rule is tests/test_engine_core.py's).

``python tests/test_structure.py`` prints the import graph of lite/, turbo/ and backends/ (module -> the modules of
the same package it imports) and the number of circles in each.
"""
from __future__ import annotations

import ast
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = [p for pkg in ("lite", "turbo", "backends") for p in sorted((ROOT / pkg).rglob("*.py"))]


def _imports(path: Path) -> list[str]:
    """Absolute module names ``path`` imports (relative imports resolved against its package), lazy ones included."""
    pkg = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[:len(pkg) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
    return out


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("pkg, banned", [("backends", ("lite", "turbo")), ("lite", ("turbo",))])
def test_lower_packages_do_not_import_upper_ones(pkg, banned):
    bad = [(_rel(p), m) for p in SHIPPED if _rel(p).startswith(pkg + "/") for m in _imports(p)
           if m.split(".")[0] in banned]
    assert bad == []


def test_sessions_loop_and_http_use_only_the_core_public_api():
    files = [ROOT / "turbo/session.py", ROOT / "turbo/loop.py", ROOT / "turbo/engine.py",
             *sorted((ROOT / "turbo/serve").glob("*.py")), *sorted((ROOT / "turbo/engine_proc").glob("*.py"))]
    pattern = re.compile(r"engine\._|\.scheduler\.|\.block_manager\.|\.runner\.")
    bad = [f"{_rel(p)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
           if pattern.search(line)]
    assert bad == []


def test_functions_stay_readable():
    long_funcs = []
    for p in SHIPPED:
        limit = 60 if _rel(p).startswith(("turbo/serve/", "turbo/engine_proc/")) else 140
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > limit:
                long_funcs.append((_rel(p), node.name, node.end_lineno - node.lineno + 1))
    assert long_funcs == []


def test_every_shipped_module_has_a_docstring():
    assert [_rel(p) for p in SHIPPED if ast.get_docstring(ast.parse(p.read_text())) is None
            and p.read_text().strip()] == []


# --- import graphs and their circles ------------------------------------------------------------------------------
PACKAGES = ("lite", "turbo", "backends")


def package_modules(pkg: str) -> dict[str, Path]:
    """Dotted module name → file, for every module of ``pkg`` (a package's ``__init__.py`` is the package)."""
    out = {}
    for p in sorted((ROOT / pkg).rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _import_targets(node: ast.AST, module: str, is_pkg: bool, mods) -> list[str]:
    """The module names one import statement reaches: ``import a.b`` → ``a.b``; ``from a import n`` → ``a.n`` when
    that is a module, else ``a`` (its ``__init__``); relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_pkg else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        src = ".".join(base + ([node.module] if node.module else []))
    else:
        src = node.module or ""
    return [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in node.names]


def import_graph(pkg: str) -> dict[str, set[str]]:
    """Module → the modules of ``pkg`` it imports, at module level or inside a function alike."""
    mods = package_modules(pkg)
    graph = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            for t in _import_targets(node, m, path.name == "__init__.py", mods):
                while t and t not in mods:  # a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t and t != m:
                    graph[m].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module (Tarjan's
    algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return sorted(found)


def without(graph: dict[str, set[str]], prefix: str) -> dict[str, set[str]]:
    """``graph`` less the modules named ``prefix`` or under it (and every edge to them)."""
    def out(m):
        return m == prefix or m.startswith(prefix + ".")
    return {m: {t for t in ts if not out(t)} for m, ts in graph.items() if not out(m)}


def test_circle_finder_on_hand_built_graphs():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"g"}}
    assert circles(g) == [["a", "b", "c"], ["e", "f"]]
    assert circles(without(g, "e")) == [["a", "b", "c"]]
    assert circles({"x": {"y"}, "y": set()}) == []


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_import_circles(pkg):
    graph = import_graph(pkg)
    assert circles(graph) == []


# --- private names --------------------------------------------------------------------------------------------
def private_imports(path: Path) -> list[tuple[str, str, str, int]]:
    """``from M import _name`` in ``path`` where M is a module of lite, turbo or backends and ``_name`` is private
    (a leading underscore, not a dunder): (file, M, name, line)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        src = _import_targets(node, module.removesuffix(".__init__"), path.name == "__init__.py", ())[0]
        if src.split(".")[0] not in PACKAGES:
            continue
        out += [(_rel(path), src, a.name, node.lineno) for a in node.names
                if a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__"))]
    return out


def test_no_module_imports_another_modules_private_names():
    bad = [f for p in SHIPPED for f in private_imports(p)]
    assert bad == [], "import the public name (or make it public where it is defined): " + repr(bad)


# --- the engine core's public API ---------------------------------------------------------------------------------
# the floors above the core: they reach it only through ``from turbo.core import NAME`` (turbo.core.__all__)
ABOVE_CORE = ["turbo/engine.py", "turbo/session.py", "turbo/loop.py", "turbo/perplexity.py",
              *(f"turbo/{d}/" for d in ("serve", "engine_proc"))]


def _core_imports(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) of every import of ``turbo.core`` or its modules in ``path``, lazy ones included."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    pkg = module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("turbo.core")]
        elif isinstance(node, ast.ImportFrom):
            base = pkg[:len(pkg) - node.level + 1] if node.level else []
            src = ".".join(base + ([node.module] if node.module else []))
            if src == "turbo" and any(a.name == "core" for a in node.names):
                out.append(("turbo.core", "*", node.lineno))
            elif src.startswith("turbo.core"):
                out += [(src, a.name, node.lineno) for a in node.names]
    return out


def test_floors_above_the_core_import_only_its_public_api():
    import turbo.core

    files = [p for p in SHIPPED if any(_rel(p) == f or _rel(p).startswith(f) for f in ABOVE_CORE)]
    assert len(files) > 10
    bad = [(_rel(p), src, name, line) for p in files for src, name, line in _core_imports(p)
           if src != "turbo.core" or name not in turbo.core.__all__]
    assert bad == [], "import these through `from turbo.core import NAME` (add a name to turbo/core/__init__.py " \
                      "only if it is meant to be public): " + repr(bad)
    assert all(getattr(turbo.core, name) is not None for name in turbo.core.__all__)


def _doc_section(title: str) -> str:
    text = (ROOT / "docs/architecture.md").read_text(encoding="utf-8")
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_architecture_doc_lists_the_core_public_api_exactly():
    import turbo.core
    from turbo.core.engine import EngineCore

    section = _doc_section("The core's public API (what sessions, the loop and the server may use)")
    package_part, methods_part = section.split("`EngineCore`'s methods and properties", 1)
    methods_part, attrs_part = methods_part.split("Its read-only attributes", 1)
    names = lambda text: set(re.findall(r"`(\w+)`", text))  # noqa: E731
    assert names(package_part) == set(turbo.core.__all__)
    public = {n for n, v in vars(EngineCore).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    assert names(methods_part) == public
    init = ast.parse(inspect.getsource(EngineCore.__init__).strip().replace("\n    ", "\n"))
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                for t in [n]}
    assert names(attrs_part) <= assigned


def test_engine_core_step_reads_schedule_run_update_in_25_lines():
    from turbo.core.engine import EngineCore
    from turbo.core.scheduler import Scheduler

    lines, _ = inspect.getsourcelines(EngineCore.step)
    assert len(lines) <= 25
    body = "".join(lines)
    assert body.index("schedule()") < body.index("_execute(") < body.index("update_from_output(")
    src = (ROOT / "turbo/core/scheduler.py").read_text(encoding="utf-8")
    assert "on_admit" not in src and "on_evict" not in src
    assert "import torch" not in src and "from torch" not in src
    assert not any(callable(v) for v in vars(Scheduler(__import__("turbo.core.block_manager", fromlist=["x"])
                                                       .BlockManager(2, 4))).values())


def test_the_router_and_the_remote_client_load_no_engine_code():
    import subprocess

    code = ("import sys, turbo.router, turbo.remote; "
            "print(sorted(m for m in sys.modules if m.startswith(('turbo.core', 'turbo.engine', 'turbo.serve'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def main() -> int:
    """Print each package's import graph and its circles; the exit status is the number of circles found."""
    total = 0
    for pkg in PACKAGES:
        graph = import_graph(pkg)
        print(f"== {pkg}/ ({len(graph)} modules)")
        for m in sorted(graph):
            print(f"{m} -> {', '.join(sorted(graph[m])) or '(none)'}")
        found = circles(graph)
        for c in found:
            print("circle:", " <-> ".join(c))
        print(f"{len(found)} circles in {pkg}/\n")
        total += len(found)
    return total


if __name__ == "__main__":
    sys.exit(1 if main() else 0)


def test_no_bench_script_shadows_an_installed_module():
    """Running a ``bench/`` script puts ``bench/`` first on ``sys.path``: a script named like an installed top-level
    module (``bench/kernels.py`` vs the ``kernels`` package transformers imports) replaces it in every import."""
    import importlib.metadata
    import sys

    installed = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert scripts, "bench/ has no scripts"
    clash = sorted(scripts & installed)
    assert not clash, f"bench/ scripts named like installed modules (rename them): {clash}"
