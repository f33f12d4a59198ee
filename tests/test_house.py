"""House rules of the code base, checked over every moepeak module (each rule has a test that
shows it can fail):

- no module (nor a test or benchmark) takes a moepeak module's private name, neither by
  `from .x import _name` nor by attribute access `x._name` on a moepeak module bound by an
  import (at module level or inside functions); the compiled extension moepeak._C is the one
  private module the package shares;
- no import cycle among moepeak's modules, counting imports inside functions too, an import
  of a package as one of its __init__, and the packages above an imported module that its
  import runs first;
- the layout's boundaries: a module of one subpackage takes from another only that
  subpackage's public face (the names its __init__ exports in __all__) or its `sizes`
  module (public by design); moepeak.core is shared by all and imports no other
  subpackage; no module imports the package facade `moepeak` (its lazy names) or uses
  importlib; moepeak.testing, the tests' switches, is the one module that reaches inside;
- every subpackage's __init__ has a docstring that states its public face, and exports
  exactly it: its __all__ lists every public name it defines or takes from its own modules,
  and only names it binds; no package exports a name that is also one of its submodules
  (the name would hide the module: torchtitan finds moepeak.titan's overrides that way);
- every module imports first in a fresh interpreter;
- no Python file outside tests/ is over 500 lines (C/CUDA: 600) unless its first docstring
  (or leading comment) has a line saying why: "over 500 lines: <reason>" ("over 600 lines:"
  for C/CUDA).
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
CORE = "moepeak.core"
# Public by design in every subpackage that has one: the byte formulas (the planner reads them).
PUBLIC_MODULES = ("sizes",)
# The test hooks: the switches tests and benchmarks turn inside the schedules.
REACHES_INSIDE = {"moepeak.testing"}
MAX_LINES = {".py": 500, ".sh": 500, ".c": 600, ".h": 600, ".cu": 600, ".cuh": 600, ".cpp": 600}
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
SUBPACKAGES = sorted(p for p in PACKAGES if p.count(".") == 1)


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def _package_of(module, packages=PACKAGES):
    return module if module in packages else module.rsplit(".", 1)[0]


def _subpackage_of(module):
    """moepeak.X for a module in the subpackage moepeak.X, None for the facade and the
    top-level modules (moepeak.norms, moepeak.cli, ...)."""
    parts = module.split(".")
    top = ".".join(parts[:2])
    return top if len(parts) >= 2 and top in PACKAGES else None


def _resolve(module, node, packages=PACKAGES):
    """The absolute module an ImportFrom node names (None if outside moepeak)."""
    if node.level == 0:
        base = node.module or ""
    else:
        base = _package_of(module, packages)
        for _ in range(node.level - 1):
            base = base.rsplit(".", 1)[0]
        if node.module:
            base = f"{base}.{node.module}"
    return base if base == "moepeak" or base.startswith("moepeak.") else None


class _Imports(ast.NodeVisitor):
    """Walks one module: records every moepeak import (imported module, names taken from it
    or None for a module import, at module level?, line), the names bound to moepeak
    modules, the private attributes read off those names, and any importlib use."""

    def __init__(self, module, modules=None, packages=PACKAGES):
        self.module = module
        self.modules = MODULE_FILES if modules is None else modules
        self.packages = packages
        self.imports = []  # (target module, names or None, module level?, line)
        self.private = []  # (what, line)
        self.module_names = {}  # local name -> moepeak module it is bound to
        self.importlib = []  # lines
        self.depth = 0

    def _known(self, name):
        return name in self.modules or name in SHARED_PRIVATE

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name == "importlib" or alias.name.startswith("importlib."):
                self.importlib.append(node.lineno)
            if alias.name == "moepeak" or alias.name.startswith("moepeak."):
                self.imports.append((alias.name, None, self.depth == 0, node.lineno))
                if alias.asname:
                    self.module_names[alias.asname] = alias.name
                else:
                    self.module_names["moepeak"] = "moepeak"

    def visit_ImportFrom(self, node):
        if (node.module or "").split(".")[0] == "importlib" and node.level == 0:
            self.importlib.append(node.lineno)
        base = _resolve(self.module, node, self.packages)
        if base is None:
            return
        names = []
        for alias in node.names:
            full = f"{base}.{alias.name}"
            if self._known(full) and full != base:  # a module: from . import x
                self.imports.append((full, None, self.depth == 0, node.lineno))
                self.module_names[alias.asname or alias.name] = full
                if _is_private(alias.name) and full not in SHARED_PRIVATE:
                    self.private.append((f"module {full}", node.lineno))
            else:
                names.append(alias.name)
                if _is_private(alias.name) and base not in SHARED_PRIVATE and base != self.module:
                    self.private.append((f"{base}.{alias.name}", node.lineno))
        if names:
            self.imports.append((base, names, self.depth == 0, node.lineno))

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "__import__":
            self.importlib.append(node.lineno)
        self.generic_visit(node)

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
                if not self._known(target):
                    break
                owner = target
        self.generic_visit(node)


def _scan(module):
    visitor = _Imports(module)
    visitor.visit(ast.parse(MODULE_FILES[module].read_text()))
    return visitor


SCANS = {m: _scan(m) for m in MODULES}


def test_modules_found():
    assert {"moepeak", "moepeak.core", "moepeak.llep", "moepeak.ring_dtp", "moepeak.sco", "moepeak.stream_adamw",
            "moepeak.tiled", "moepeak.hf", "moepeak.titan", "moepeak.plan", "moepeak.demo"} <= PACKAGES
    assert {"moepeak.llep.sizes", "moepeak.ring_dtp.sizes", "moepeak.demo.models", "moepeak.testing",
            "moepeak.norms"} <= set(MODULES)


# ---------------------------------------------------------------- private names

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
    src = ("from .llep.gemm import _X\nimport moepeak.sco as s\nfrom .llep import sched\n"
           "def f():\n    return s._arena, sched.run, moepeak._C.x\n")
    visitor = _Imports("moepeak.probe")
    visitor.visit(ast.parse(src))
    assert [w for w, _ in visitor.private] == ["moepeak.llep.gemm._X", "moepeak.sco._arena"]


# ---------------------------------------------------------------- import cycles

def _import_graph(scans, modules, packages):
    """module -> the modules its imports run: each imported module (a package: its
    __init__), at module level or in a function, and the packages above it that are not
    above the importer (its import runs their __init__ first). moepeak's own __init__ runs
    before everything and is left out, as the extension is."""
    graph = {}
    for m, scan in scans.items():
        mine = set()
        parts = m.split(".")
        for i in range(2, len(parts) + 1):
            mine.add(".".join(parts[:i]))
        deps = set()
        for target, _, _, _ in scan.imports:
            if target not in modules or target == "moepeak":
                continue
            deps.add(target)
            tparts = target.split(".")
            for i in range(2, len(tparts)):
                above = ".".join(tparts[:i])
                if above in packages and above not in mine:
                    deps.add(above)
        deps.discard(m)
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


def test_no_import_cycle():
    cycle = _find_cycle(_import_graph(SCANS, MODULE_FILES, PACKAGES))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _scan_sources(sources):
    """{module: source} of a made-up package, scanned as the real one is."""
    modules = {m: None for m in sources}
    packages = {m for m in sources if m == "moepeak" or any(o.startswith(m + ".") for o in sources)}
    scans = {}
    for m, src in sources.items():
        v = _Imports(m, modules, packages)
        v.visit(ast.parse(src))
        scans[m] = v
    return scans, modules, packages


def test_the_cycle_check_can_fail():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    # a cycle through a function-level import, and one through a package's __init__
    scans, modules, packages = _scan_sources({
        "moepeak": "", "moepeak.a": "from .x import f\n", "moepeak.a.x": "def f():\n    from ..b import y\n",
        "moepeak.b": "", "moepeak.b.y": "from ..a import f\n"})
    assert _find_cycle(_import_graph(scans, modules, packages)) == ["moepeak.a", "moepeak.a.x", "moepeak.b.y",
                                                                    "moepeak.a"]
    scans, modules, packages = _scan_sources({
        "moepeak": "", "moepeak.a": "from .x import f\n", "moepeak.a.x": "def f():\n    from . import z\n",
        "moepeak.a.z": "from . import f\n"})
    assert _find_cycle(_import_graph(scans, modules, packages)) is not None
    # importing a module of another package runs that package's __init__ first
    scans, modules, packages = _scan_sources({
        "moepeak": "", "moepeak.a": "from .x import f\n", "moepeak.a.x": "from ..b.y import g\n",
        "moepeak.b": "from .z import h\n", "moepeak.b.y": "", "moepeak.b.z": "from ..a import f\n"})
    assert _find_cycle(_import_graph(scans, modules, packages)) is not None


# ---------------------------------------------------------------- the layout's boundaries

def _all_value(node):
    """The value of an `__all__ = ...` assignment: a list of strings, or such lists joined with +
    and sorted() (the facade's)."""
    return list(eval(compile(ast.Expression(node.value), "__all__", "eval"), {"__builtins__": {}, "sorted": sorted}))


def _exports(package):
    """The names in a package __init__'s __all__."""
    for node in ast.parse(MODULE_FILES[package].read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(_all_value(node))
    return set()


def _boundary_violations(module, scan, exports, subpackage_of=_subpackage_of, packages=PACKAGES):
    """What `module` imports across the layout's boundaries (see the module docstring)."""
    bad = []
    if scan.importlib:
        bad.append(f"importlib / __import__ at line(s) {scan.importlib}")
    mine = subpackage_of(module)
    for target, names, _, line in scan.imports:
        if target in SHARED_PRIVATE:
            continue
        if target == "moepeak":
            if module != "moepeak":
                bad.append(f"line {line}: imports the package facade moepeak ({names or 'import moepeak'}); "
                           f"import the subpackage that owns the name")
            continue
        theirs = subpackage_of(target)
        if mine == CORE and theirs not in (None, CORE):
            bad.append(f"line {line}: moepeak.core imports {target}: core imports no other subpackage")
        if theirs is None or theirs == mine or theirs == CORE or module in REACHES_INSIDE:
            continue
        if target == theirs:  # the subpackage's __init__: its public face
            hidden = sorted(set(names or ()) - exports(theirs))
            if hidden:
                bad.append(f"line {line}: takes {hidden} from {theirs}, which does not export them (__all__)")
            continue
        if target.split(".")[2:] and target.split(".")[2] in PUBLIC_MODULES and target.count(".") == 2:
            continue
        bad.append(f"line {line}: imports {target}, an internal module of {theirs} (take its public face: "
                   f"`from {theirs} import ...`, or its sizes module)")
    return bad


@pytest.mark.parametrize("module", MODULES)
def test_no_module_reaches_into_another_subpackage(module):
    bad = _boundary_violations(module, SCANS[module], _exports)
    assert not bad, f"{module}: " + "; ".join(bad)


def test_the_boundary_check_can_fail():
    exports = {"moepeak.llep": {"llep_moe"}, "moepeak.sco": {"SCOConfig"}, "moepeak.core": set()}.get
    sources = {
        "moepeak.hf.loss": ("from ..llep import llep_moe, GPT_OSS_ALPHA\nfrom ..llep.sched import forward\n"
                            "from ..llep import sizes\nfrom ..core.ext import check_tensor\n"
                            "def f():\n    from .. import linear_cross_entropy\n    import importlib\n"),
        "moepeak.core.ext": "from ..sco import SCOConfig\nfrom .. import _C\n",
        "moepeak.testing": "from .llep import gemm\n",
    }
    packages = {"moepeak", "moepeak.hf", "moepeak.llep", "moepeak.sco", "moepeak.core"}
    modules = dict.fromkeys(packages | set(sources) | {"moepeak.llep.sched", "moepeak.llep.sizes",
                                                       "moepeak.llep.gemm"})

    def subpackage_of(m):
        top = ".".join(m.split(".")[:2])
        return top if m.count(".") >= 1 and top in packages else None

    found = {}
    for m, src in sources.items():
        v = _Imports(m, modules, packages)
        v.visit(ast.parse(src))
        found[m] = _boundary_violations(m, v, exports, subpackage_of, packages)
    hf = found["moepeak.hf.loss"]
    assert len(hf) == 4, hf
    assert hf[0].startswith("importlib")
    assert "['GPT_OSS_ALPHA']" in hf[1] and "moepeak.llep.sched" in hf[2] and "facade" in hf[3]
    assert len(found["moepeak.core.ext"]) == 1 and "core imports no other" in found["moepeak.core.ext"][0]
    assert found["moepeak.testing"] == []


def _init_face(package):
    """(docstring, __all__ or None, names the __init__ binds publicly: defined, or taken from
    its own package's modules, submodules left out; every name it binds; the names bound to
    its own submodules)."""
    tree = ast.parse(MODULE_FILES[package].read_text())
    doc, exported, public, bound, modules = ast.get_docstring(tree) or "", None, set(), set(), set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            public.add(node.name)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    if t.id == "__all__":
                        exported = _all_value(node)
                    else:
                        bound.add(t.id)
                        public.add(t.id)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                name = a.asname or a.name
                bound.add(name)
                if node.level == 1 and node.module and f"{package}.{node.module}.{a.name}" not in MODULE_FILES:
                    public.add(name)  # from .x import name: taken from its own module
                elif node.level == 1 and not node.module and a.asname in (None, a.name):
                    modules.add(name)  # from . import x: the submodule itself
        elif isinstance(node, ast.Import):
            for a in node.names:
                bound.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.Try):  # optional imports (torchtitan's names) bind names too
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    bound.update(a.asname or a.name for a in sub.names)
    return doc, exported, {n for n in public if not n.startswith("_")}, bound, modules


def _face_problems(package, face, submodules=None):
    doc, exported, public, bound, modules = face
    problems = []
    if "public face" not in doc.lower():
        problems.append("its docstring does not state its public face ('Public face ...')")
    if exported is None:
        return problems + ["no __all__"]
    if package != "moepeak":  # the facade's names are bound on first use (its __getattr__)
        unbound = sorted(set(exported) - bound)
        if unbound:
            problems.append(f"__all__ names what it does not bind: {unbound}")
    unlisted = sorted(public - set(exported) - {"annotations"})
    if unlisted:
        problems.append(f"binds public names it does not export (__all__): {unlisted}")
    if submodules is None:
        submodules = {m.rsplit(".", 1)[1] for m in MODULE_FILES if m.rsplit(".", 1)[0] == package and m != package}
    hiding = sorted(set(exported) & submodules - modules)
    if hiding:
        problems.append(f"exports names of its own submodules, which they would hide: {hiding}")
    return problems


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_each_package_states_and_exports_its_public_face(package):
    problems = _face_problems(package, _init_face(package))
    assert not problems, f"{package}/__init__.py: " + "; ".join(problems)


def test_the_public_face_check_can_fail():
    ok = ("the doc. Public face: f.", ["f"], {"f"}, {"f", "torch"}, set())
    assert _face_problems("moepeak.probe", ok) == []
    assert "does not state" in _face_problems("moepeak.probe", ("the doc", ["f"], {"f"}, {"f"}, set()))[0]
    assert _face_problems("moepeak.probe", (ok[0], None, set(), set(), set())) == ["no __all__"]
    assert "does not bind" in _face_problems("moepeak.probe", (ok[0], ["f", "g"], {"f"}, {"f"}, set()))[0]
    assert "does not export" in _face_problems("moepeak.probe", (ok[0], ["f"], {"f", "g"}, {"f", "g"}, set()))[0]
    # moepeak.plan's submodule table.py: exporting another object as `table` would hide it;
    # exporting the submodule itself (from . import table) hides nothing
    assert "would hide" in _face_problems("moepeak.plan", (ok[0], ["table"], {"table"}, {"table"}, set()),
                                          submodules={"table"})[0]
    assert _face_problems("moepeak.plan", (ok[0], ["table"], set(), {"table"}, {"table"}), submodules={"table"}) == []


def test_the_facade_names_are_the_subpackages_objects():
    """Each lazy name of moepeak (but __version__) is the object that one subpackage, or a
    top-level module such as moepeak.norms, exports under that name."""
    import importlib
    import moepeak
    homes = [importlib.import_module(m) for m in MODULES
             if m.count(".") == 1 and not m.endswith("__main__") and m not in ("moepeak.testing", "moepeak.cli")]
    assert "__version__" in moepeak.__all__
    assert moepeak.__version__ == importlib.import_module("moepeak.version").__version__
    for name in sorted(set(moepeak.__all__) - {"__version__"}):
        owners = [h for h in homes if name in getattr(h, "__all__", ())]
        assert len(owners) == 1, (name, [h.__name__ for h in owners])
        assert getattr(moepeak, name) is getattr(owners[0], name), name
    with pytest.raises(AttributeError, match="no_such_thing"):
        moepeak.no_such_thing  # noqa: B018


# ---------------------------------------------------------------- fresh imports

@pytest.mark.parametrize("module", [m for m in MODULES if not m.endswith(".__main__")])  # __main__ runs the CLI
def test_imports_first_in_a_fresh_interpreter(module):
    r = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# ---------------------------------------------------------------- file length

def _source_files():
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in MAX_LINES and path.is_file() and "build" not in path.relative_to(ROOT).parts:
                yield path
    for path in sorted(ROOT.glob("*")):
        if path.suffix in MAX_LINES and path.is_file():
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
        elif s.startswith("//") or s.startswith("#!") or (path.suffix == ".sh" and s.startswith("#")):
            lines.append(s)
        elif s or lines:
            break
    return "\n".join(lines)


def _length_problem(path, text):
    n, limit = len(text.splitlines()), MAX_LINES[path.suffix]
    if n > limit and f"over {limit} lines:" not in _leading_text(path, text):
        return (f"{path.name} has {n} lines (> {limit}): split it along its seams or say why in its first "
                f"docstring/comment ('over {limit} lines: ...')")
    return None


def test_source_files_found():
    names = {p.relative_to(ROOT).as_posix() for p in _source_files()}
    assert {"moepeak/ring_dtp/ops.py", "csrc/llep.c", "cuda/llep.cu", "benchmarks/_common.py", "setup.py"} <= names


@pytest.mark.parametrize("path", list(_source_files()), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_long_file_without_a_reason(path):
    problem = _length_problem(path, path.read_text())
    assert problem is None, problem


def test_the_length_check_can_fail():
    py, c = pathlib.Path("x.py"), pathlib.Path("x.c")
    body = "\n" * 501
    assert _length_problem(py, '"""doc"""' + body) is not None
    assert _length_problem(py, '"""doc\n\nover 500 lines: one table of every arm."""' + body) is None
    assert _length_problem(c, "/* x */" + body) is None  # C: 600
    assert _length_problem(c, "/* x */" + "\n" * 601) is not None
