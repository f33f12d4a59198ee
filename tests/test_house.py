"""House rules of the code base, checked over every moepeak module:

- no module (nor a test or benchmark) takes a moepeak module's private name, neither by `from .x import _name`
  nor by attribute access `x._name` on a moepeak module bound by an import (at module level
  or inside functions); the compiled extension (moepeak._C, loaded by moepeak.core.ext) is
  the one private module the package shares;
- no import cycle among moepeak's modules at module level, and every module imports first in
  a fresh interpreter;
- no source file outside tests/ is over 600 lines unless its first docstring (or leading
  comment, for C/CUDA) has a line saying why: "over 600 lines: <reason>".
"""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "moepeak"
# The private module every moepeak module may use: the compiled extension.
SHARED_PRIVATE = {"moepeak._C"}
MAX_LINES = 600
SOURCE_SUFFIXES = {".py", ".c", ".h", ".cu", ".cuh", ".cpp", ".sh"}
SOURCE_DIRS = ("moepeak", "csrc", "cuda", "benchmarks", "examples", "scripts")


def _module_name(path):
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULE_FILES = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}
MODULES = sorted(MODULE_FILES)
PACKAGES = {m for m, p in MODULE_FILES.items() if p.name == "__init__.py"}


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def _package_of(module):
    return module if module in PACKAGES else module.rsplit(".", 1)[0]


def _resolve(module, node):
    """The absolute module an ImportFrom node names (None if outside moepeak)."""
    if node.level == 0:
        base = node.module or ""
    else:
        base = _package_of(module)
        for _ in range(node.level - 1):
            base = base.rsplit(".", 1)[0]
        if node.module:
            base = f"{base}.{node.module}"
    return base if base == "moepeak" or base.startswith("moepeak.") else None


class _Imports(ast.NodeVisitor):
    """Walks one module: records (imported module, taken names, at module level) and the
    names bound to moepeak modules, then the private attributes read off those names."""

    def __init__(self, module):
        self.module = module
        self.edges = []  # (target module, module level?)
        self.private = []  # (what, line)
        self.module_names = {}  # local name -> moepeak module it is bound to
        self.depth = 0

    def _edge(self, target):
        self.edges.append((target, self.depth == 0))

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name == "moepeak" or alias.name.startswith("moepeak."):
                self._edge(alias.name)
                if alias.asname:
                    self.module_names[alias.asname] = alias.name
                else:
                    self.module_names["moepeak"] = "moepeak"

    def visit_ImportFrom(self, node):
        base = _resolve(self.module, node)
        if base is None:
            return
        for alias in node.names:
            full = f"{base}.{alias.name}"
            if full in MODULE_FILES or full in SHARED_PRIVATE:  # a module: from . import x
                self._edge(full)
                self.module_names[alias.asname or alias.name] = full
                if _is_private(alias.name) and full not in SHARED_PRIVATE:
                    self.private.append((f"module {full}", node.lineno))
            else:
                self._edge(base)
                if _is_private(alias.name) and base not in SHARED_PRIVATE and base != self.module:
                    self.private.append((f"{base}.{alias.name}", node.lineno))

    def visit_Attribute(self, node):
        chain, inner = [node.attr], node.value
        while isinstance(inner, ast.Attribute):
            chain.append(inner.attr)
            inner = inner.value
        if isinstance(inner, ast.Name) and inner.id in self.module_names:
            owner = self.module_names[inner.id]
            for attr in reversed(chain):
                target = f"{owner}.{attr}"
                if _is_private(attr) and target not in SHARED_PRIVATE and owner != self.module:
                    self.private.append((target, node.lineno))
                    break
                if target not in MODULE_FILES and target not in SHARED_PRIVATE:
                    break
                owner = target
        self.generic_visit(node)


def _scan(module):
    visitor = _Imports(module)
    visitor.visit(ast.parse(MODULE_FILES[module].read_text()))
    return visitor


SCANS = {m: _scan(m) for m in MODULES}


def test_modules_found():
    assert {"moepeak", "moepeak.ring_dtp", "moepeak.llep", "moepeak.sco", "moepeak.stream_adamw",
            "moepeak.demo", "moepeak.demo.models", "moepeak.testing"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_no_private_names_of_other_modules(module):
    assert not SCANS[module].private, f"{module} reaches private names: {SCANS[module].private}"


USER_FILES = sorted(list((ROOT / "tests").glob("*.py")) + list((ROOT / "benchmarks").rglob("*.py")))


@pytest.mark.parametrize("path", USER_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_tests_and_benchmarks_use_no_private_names(path):
    """Tests and benchmarks use moepeak's public names and moepeak.testing's hooks."""
    visitor = _Imports("user." + path.stem)
    visitor.visit(ast.parse(path.read_text()))
    assert not visitor.private, f"{path.relative_to(ROOT)} reaches private names: {visitor.private}"


def test_the_private_name_check_can_fail():
    src = ("from .llep_gemm import _X\nimport moepeak.sco as s\nfrom . import llep_sched\n"
           "def f():\n    return s._arena, llep_sched.run, moepeak._C.x\n")
    visitor = _Imports("moepeak.probe")
    visitor.visit(ast.parse(src))
    assert [w for w, _ in visitor.private] == ["moepeak.llep_gemm._X", "moepeak.sco._arena"]


def _module_level_graph():
    graph = {}
    for m, scan in SCANS.items():
        deps = set()
        for target, top in scan.edges:
            # A package's __init__ runs before any of its modules anyway: not an edge.
            if top and target in MODULE_FILES and target not in PACKAGES and target != m:
                deps.add(target)
        graph[m] = deps
    return graph


def _find_cycle(graph):
    state = {}

    def visit(m, path):
        if state.get(m) == "done":
            return None
        if state.get(m) == "open":
            return path[path.index(m):] + [m]
        state[m] = "open"
        for dep in sorted(graph.get(m, ())):
            cycle = visit(dep, path + [m])
            if cycle:
                return cycle
        state[m] = "done"
        return None

    for m in sorted(graph):
        cycle = visit(m, [])
        if cycle:
            return cycle
    return None


def test_no_module_level_import_cycle():
    cycle = _find_cycle(_module_level_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_can_fail():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", [m for m in MODULES if not m.endswith(".__main__")])  # __main__ runs the CLI
def test_imports_first_in_a_fresh_interpreter(module):
    r = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def _source_files():
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in SOURCE_SUFFIXES and path.is_file() and "build" not in path.relative_to(ROOT).parts:
                yield path
    for path in sorted(ROOT.glob("*")):
        if path.suffix in SOURCE_SUFFIXES and path.is_file():
            yield path


def _leading_text(path, text):
    """A Python file's module docstring, or a C/CUDA file's leading comment block."""
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(text)) or ""
    lines, in_block = [], False
    for line in text.splitlines():
        s = line.strip()
        if in_block:
            lines.append(s)
            in_block = "*/" not in s
        elif s.startswith("/*"):
            lines.append(s)
            in_block = "*/" not in s
        elif s.startswith("//") or s.startswith("#!"):
            lines.append(s)
        elif s or lines:
            break
    return "\n".join(lines)


def test_source_files_found():
    names = {p.relative_to(ROOT).as_posix() for p in _source_files()}
    assert {"moepeak/ring_dtp/ops.py", "csrc/llep.c", "cuda/llep.cu", "benchmarks/_common.py", "setup.py"} <= names


@pytest.mark.parametrize("path", list(_source_files()), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_long_file_without_a_reason(path):
    text = path.read_text()
    n = len(text.splitlines())
    if n > MAX_LINES:
        assert "over 600 lines:" in _leading_text(path, text), (
            f"{path.relative_to(ROOT)} has {n} lines (> {MAX_LINES}): split it along its seams or say why in "
            f"its first docstring/comment ('over 600 lines: ...')")
