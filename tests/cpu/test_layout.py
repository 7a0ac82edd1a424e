"""The package's layout rules (issue 21), checked on the source: no import cycle anywhere in
src/flash4 (module-level and late imports alike, the benchmark included), and device code
(flash4.kernels) imports no host module but flash4.constants, flash4.arch and flash4.geometry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
# What kernel modules may import from flash4 besides flash4.kernels itself: pure modules without
# torch or host state (flash4.arch imports torch only inside its device queries).
DEVICE_MAY_IMPORT = ("flash4.constants", "flash4.arch", "flash4.geometry")


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted((SRC / "flash4").rglob("*.py")):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return mods


def import_edges() -> dict[str, set[str]]:
    """module -> the flash4 modules it imports (anywhere in its body), resolved to known modules;
    a module importing its own parent package (or flash4 itself) is not an edge."""
    mods = _modules()
    edges = {m: set() for m in mods}
    for m, path in mods.items():
        pkg = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != m and not m.startswith(t + ".") and t != "flash4":
                    edges[m].add(t)
    return edges


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    cycles = find_cycles(import_edges())
    assert not cycles, "import cycles in src/flash4: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_find_cycles_finds_one():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module", sorted(m for m in _modules() if m.startswith("flash4.kernels")))
def test_device_code_imports_no_host_module(module):
    bad = sorted(t for t in import_edges()[module]
                 if not t.startswith("flash4.kernels") and t not in DEVICE_MAY_IMPORT)
    assert not bad, f"{module} imports host modules {bad} (allowed beside flash4.kernels: {DEVICE_MAY_IMPORT})"
