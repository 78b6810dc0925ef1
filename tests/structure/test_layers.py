"""The package's layers, drawn from its imports: every import points down, none sits inside a
function (except of heavy optional packages), and the core never imports Qt, napari or CuPy at
import time.  ``docs/design.md`` shows the diagram."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "napari_tileshard"

#: bottom to top; modules of one tier never import each other across subpackages (engine and reader
#: are siblings), a subpackage's own modules may import each other
LAYERS = {
    "format": 0,
    "gpu": 1,
    "storage": 2,
    "engine": 3,
    "reader": 3,
    "apps": 4,
    "testing": 4,
    "_qt": 5,
    "": 6,  # the package itself: __init__ (the public API) and __main__
}
HEAVY = ("cupy", "napari", "qtpy", "PyQt5", "PyQt6", "PySide2", "PySide6", "superqt", "magicgui", "dask", "distributed")


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else ""


def imports(module: str, path: Path):
    """(target module, line, inside a function) of every import of this package in ``module``."""
    tree = ast.parse(path.read_text())
    in_function = {
        id(node)
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
    }
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "napari_tileshard":
                target = node.module
            else:
                continue
            yield target, node.lineno, id(node) in in_function


def test_every_import_points_down_and_none_hides_in_a_function():
    found = modules()
    problems = []
    for module, path in sorted(found.items()):
        here = layer_of(module)
        for target, line, inside in imports(module, path):
            there = layer_of(target) if target in found else layer_of(target.rsplit(".", 1)[0])
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            if inside:
                problems.append(f"{where} inside a function")
            if LAYERS[there] > LAYERS[here] or (LAYERS[there] == LAYERS[here] and there != here):
                problems.append(f"{where}: {here or 'the package'} may not import {there}")
    assert not problems, "\n".join(problems)


def test_the_folders_are_the_layers():
    top = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")}
    assert top == {name for name in LAYERS if name}
    assert {p.name for p in PACKAGE.glob("*.py")} == {"__init__.py", "__main__.py"}


@pytest.mark.parametrize("layer", ["format", "gpu", "storage", "engine", "reader", "apps"])
def test_the_core_imports_no_gui_and_no_cuda(layer):
    code = (
        f"import sys, importlib, pkgutil, napari_tileshard.{layer} as p\n"
        "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'): importlib.import_module(m.name)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing the {layer} layer imports {out.strip()}"
