"""The in-rank package stays apart from the application: one seam, nothing heavy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The seam: the only code in collectors allowed to import rtop (module, function).
SEAM = ("discovery.py", "ray_hub_actor_class")


def _rtop_imports(tree: ast.AST) -> list[tuple[int, str | None]]:
    """(line, enclosing function or None) of each import of rtop in a module."""
    found: list[tuple[int, str | None]] = []

    def visit(node: ast.AST, func: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            if any(n == "rtop" or n.startswith("rtop.") for n in names):
                found.append((child.lineno, func))
            visit(child, func)

    visit(tree, None)
    return found


def test_only_the_seam_imports_rtop():
    seen = {}
    for path in sorted((ROOT / "collectors").rglob("*.py")):
        imports = _rtop_imports(ast.parse(path.read_text(), filename=str(path)))
        if imports:
            seen[path.relative_to(ROOT / "collectors").as_posix()] = imports
    module, func = SEAM
    assert list(seen) == [module], f"collectors modules importing rtop: {seen}"
    assert [f for _, f in seen[module]] == [func], (
        f"{module} may import rtop once, lazily, inside {func}(): {seen[module]}")


def test_the_seam_finds_the_ray_actor():
    from collectors.discovery import hub_command, ray_hub_actor_class
    from rtop.hub.ray_actor import RayHubActor

    assert ray_hub_actor_class() is RayHubActor
    assert hub_command("job", Path("/x/hub.json"))[1:5] == ["-m", "rtop", "serve", "--auto"]


def test_the_seam_check_catches_other_imports():
    """The checker itself: module-level, aliased and nested imports all count."""
    code = ("import rtop.hub\nfrom rtop import cli as c\n"
            "def f():\n    if True:\n        import rtop\n")
    assert _rtop_imports(ast.parse(code)) == [(1, None), (2, None), (5, "f")]
    assert _rtop_imports(ast.parse("import rtopx\nfrom .rtop import y\n")) == []


@pytest.mark.parametrize("module", [
    "collectors", "collectors.probe", "collectors.sender", "collectors.steps",
    "collectors.connection", "collectors.samplers", "collectors.discovery",
    "collectors.raytrain",
])
def test_importing_collectors_loads_nothing_heavy(module):
    code = (
        f"import sys, {module}\n"
        "bad = [m for m in ('rtop', 'textual', 'torch', 'ray') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=60)
    assert out.stdout.strip() == "", f"import {module} imported {out.stdout.strip()}"


def test_making_a_probe_loads_nothing_heavy():
    """Past import: a probe with its sender thread, closed, still loads none of them."""
    code = (
        "import os, sys\n"
        "os.environ['RTOP_AUTOHUB'] = '0'\n"
        "import collectors\n"
        "p = collectors.start()\n"
        "for _ in p.iter(range(3)):\n"
        "    with p.step():\n"
        "        pass\n"
        "p.close(0.2)\n"
        "bad = [m for m in ('rtop', 'textual', 'torch', 'ray') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    env = {"PATH": "/usr/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=60, env=env)
    assert out.stdout.strip() == "", f"a probe imported {out.stdout.strip()}"
