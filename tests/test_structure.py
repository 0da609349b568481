"""The package lines of docs/architecture.md, checked on the source: who may import whom, what the floors above the
engine core may touch, and the size limits that keep every file readable alone (the engine core's own import rule is
tests/test_engine_core.py's)."""
from __future__ import annotations

import ast
import re
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
    files = [ROOT / "turbo/session.py", ROOT / "turbo/loop.py", *sorted((ROOT / "turbo/serve").glob("*.py"))]
    pattern = re.compile(r"engine\._|\.scheduler\.|\.block_manager\.|\.runner\.")
    bad = [f"{_rel(p)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
           if pattern.search(line)]
    assert bad == []


def test_files_and_functions_stay_readable():
    long_files = [(_rel(p), n) for p in SHIPPED if (n := len(p.read_text().splitlines())) > 500]
    long_funcs = []
    for p in SHIPPED:
        limit = 60 if _rel(p).startswith("turbo/serve/") else 140
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    node.end_lineno - node.lineno + 1 > limit:
                long_funcs.append((_rel(p), node.name, node.end_lineno - node.lineno + 1))
    assert long_files == [] and long_funcs == []


def test_every_shipped_module_has_a_docstring():
    assert [_rel(p) for p in SHIPPED if ast.get_docstring(ast.parse(p.read_text())) is None
            and p.read_text().strip()] == []
