"""Ring-DTP's modules (moepeak/ring_dtp/) import without cycles and reach no other module's private names."""
import ast
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "moepeak" / "ring_dtp"
RING_MODULES = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")


def _imports(path):
    """(module imported, names taken from it) for every import of a moepeak.ring_dtp module in the
    file, at module level or inside functions."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.append((node.module, [a.name for a in node.names]))
            else:  # from . import a, b
                out.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moepeak.ring_dtp."):
            out.append((node.module.split(".", 2)[2], [a.name for a in node.names]))
    return out


def test_ring_modules_found():
    assert {"ops", "loss", "sched", "ring", "group", "blocks", "sizes", "labels"} <= set(RING_MODULES)


def test_no_import_cycle_among_ring_modules():
    graph = {m: {dep for dep, _ in _imports(PKG / f"{m}.py") if dep in RING_MODULES} for m in RING_MODULES}
    seen, done = set(), set()

    def visit(m, path):
        assert m not in seen or m in done, f"import cycle: {' -> '.join(path + [m])}"
        if m in done:
            return
        seen.add(m)
        for dep in sorted(graph[m]):
            visit(dep, path + [m])
        done.add(m)

    for m in RING_MODULES:
        visit(m, [])


@pytest.mark.parametrize("module", RING_MODULES)
def test_no_private_names_from_other_modules(module):
    bad = [(dep, n) for dep, names in _imports(PKG / f"{module}.py") for n in names
           if n.startswith("_") and not n.startswith("__") and dep != "_C"]
    assert not bad, f"moepeak.ring_dtp.{module} imports private names: {bad}"


@pytest.mark.parametrize("module", RING_MODULES)
def test_imports_fresh(module):
    """Each module imports first in a fresh interpreter (no order-dependent cycle)."""
    r = subprocess.run([sys.executable, "-c", f"import moepeak.ring_dtp.{module}"], cwd=PKG.parents[1],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
