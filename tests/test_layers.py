"""The package's imports point one way, down the layer order written in README.md, and form no
circle. Parsed from the sources (every import statement, a function's lazy ones included), so a
new module or import is checked the day it lands. The one allowed edge against the order is the
registry's import of `ops` (importing the op families declares them)."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "kernelgate"
ALLOWED = {("kernelgate.registry", "kernelgate.ops")}    # (importer, imported package)


def _allowed(a: str, b: str) -> bool:
    return any(a == x and (b == y or b.startswith(y + ".")) for x, y in ALLOWED)


def _layers() -> list:
    """README's line `cli, tools -> server -> ... -> envs, errors` -> [{names}], top first."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^`?(cli, tools ->.*?)`?$", text, re.MULTILINE)
    assert m, "README.md must state the layer order as one line: `cli, tools -> server -> ... -> envs, errors`"
    return [{n.strip() for n in part.split(",")} for part in m.group(1).split("->")]


def _modules() -> dict:
    """{dotted module name: path} of every module in the package."""
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict) -> set:
    """The kernelgate modules `name` imports (anywhere in the file)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kernelgate"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("kernelgate"):
                continue
            for a in node.names:            # `from pkg import submodule` imports the submodule
                sub = f"{mod}.{a.name}"
                found.add(sub if sub in modules else mod)
    return {m for m in found if m in modules and m != name}


def _layer_of(module: str, layers: list) -> int | None:
    if module == "kernelgate" or module == "kernelgate.__main__":
        return 0                            # the public API and the entry point: the top
    top = module.split(".")[1]
    for i, names in enumerate(layers):
        if top in names:
            return i
    return None


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer(graph):
    layers = _layers()
    missing = sorted(m for m in graph if _layer_of(m, layers) is None)
    assert not missing, f"modules in no layer of README.md's order: {missing}"


def test_imports_point_down_the_layer_order(graph):
    layers = _layers()
    bad = [f"{a} ({'/'.join(sorted(layers[_layer_of(a, layers)]))}) imports {b} "
           f"({'/'.join(sorted(layers[_layer_of(b, layers)]))})"
           for a, deps in graph.items() for b in deps
           if not _allowed(a, b) and _layer_of(a, layers) > _layer_of(b, layers)]
    assert not bad, "imports against the layer order:\n" + "\n".join(sorted(bad))


def test_no_import_circle(graph):
    edges = {a: {b for b in deps if not _allowed(a, b)} for a, deps in graph.items()}
    state, stack, circles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                circles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m)
        stack.pop()
        state[n] = 2
    for n in sorted(edges):
        if n not in state:
            visit(n)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles[:10])


def test_the_check_catches_a_wrong_way_import(tmp_path):
    """The parser sees relative imports of both kinds, and the order check would reject one."""
    layers = _layers()
    src = tmp_path / "x.py"
    src.write_text("from ..engine import engine\nfrom ..serving.generate import generate\n")
    modules = {"kernelgate.engine": None, "kernelgate.engine.engine": None, "kernelgate.serving.generate": None}
    got = _imports("kernelgate.executor.x", src, modules)
    assert got == {"kernelgate.engine.engine", "kernelgate.serving.generate"}
    assert _layer_of("kernelgate.executor.x", layers) > _layer_of("kernelgate.engine.engine", layers)
