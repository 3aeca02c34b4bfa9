"""The application's import arrows run one way:
tui → client/report → hub → analysis → run → collectors.

Every ``import`` in ``rtop/`` (lazy ones inside functions and ``TYPE_CHECKING`` ones
included) is read with ``ast``; a module may import from its own layer or below, never
above. A cycle between two layers (the hub and the analysis importing each other, as
they once did) fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Lowest first. A module is in the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("collectors",),
    ("rtop", "rtop.fmt", "rtop.run"),
    ("rtop.analysis",),
    ("rtop.hub",),
    ("rtop.client", "rtop.report", "rtop.export", "rtop.discovery", "rtop.actions",
     # a simulated fleet written as a recording (the hub's recorder), and how right the
     # diagnosis was on it: tools for tests and benchmarks, like the report
     "rtop.fleetsim", "rtop.fleetscore"),
    ("rtop.tui",),
    ("rtop.cli", "rtop.demo", "rtop.launch", "rtop.workload", "rtop.__main__"),
)


def layer_of(module: str) -> int | None:
    """The layer of a dotted module name (None: not rtop's, e.g. numpy)."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            named = module == prefix or module.startswith(prefix + ".")
            if named and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level)
    return best[1] if best is not None else None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, me: str) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in module ``me`` (read from ``path``),
    relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = me
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            out.append((node.lineno, base))
            # ``from rtop import tui`` names a module, not an attribute
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                    if (ROOT / Path(*base.split("."), alias.name)).is_dir()
                    or (ROOT / Path(*base.split("."), f"{alias.name}.py")).exists()]
    return out


SOURCES = sorted((ROOT / "rtop").rglob("*.py"))


def test_every_rtop_module_has_a_layer():
    missing = [module_name(p) for p in SOURCES if layer_of(module_name(p)) is None]
    assert not missing, f"modules the layer table does not place: {missing}"


def upward_imports(path: Path, me: str) -> list[str]:
    """The imports of module ``me`` that point to a higher layer than its own."""
    mine = layer_of(me)
    assert mine is not None
    return [f"line {line}: {me} (layer {mine}) imports {mod} (layer {layer_of(mod)})"
            for line, mod in imports_of(path, me) if (layer_of(mod) or 0) > mine]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_point_down(path):
    upward = upward_imports(path, module_name(path))
    assert not upward, "imports against the arrows:\n" + "\n".join(upward)


def test_the_check_catches_an_upward_import(tmp_path):
    """The analysis importing the hub (the cycle that was) is caught, written either way."""
    assert layer_of("rtop.hub.server") > layer_of("rtop.analysis.engine")
    assert layer_of("rtop.analysis") > layer_of("rtop.run.state")
    assert layer_of("rtop.tui.app") > layer_of("rtop.report")
    bad = tmp_path / "upward.py"
    bad.write_text("import numpy\n\ndef later():\n    from ..hub import server\n")
    found = upward_imports(bad, "rtop.analysis.upward")
    want = "line 4: rtop.analysis.upward (layer 2) imports rtop.hub.server (layer 3)"
    assert want in found, found
    bad.write_text("from rtop.tui.app import make_app\n")
    assert upward_imports(bad, "rtop.report") and not upward_imports(bad, "rtop.cli")
