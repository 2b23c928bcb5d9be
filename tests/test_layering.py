"""The package's layers: the core (policy, eager, scaling, levels, step, diagnostics) never
imports the bench layer or the command line; optional dependencies are imported on first use
through `mixprec._optional`, which sits below everything."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import mixprec

PACKAGE = pathlib.Path(mixprec.__file__).parent
UPPER = ("mixprec.bench", "mixprec.cli", "mixprec.__main__")


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_the_core_never_imports_the_bench_layer_or_the_cli():
    upper = ("bench", "cli.py", "__main__.py")
    core = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in upper]
    assert len(core) > 20
    for path in core:
        bad = sorted(n for n in _imports(path) if n.startswith(UPPER))
        assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def test_optional_dependencies_sit_below_everything():
    allowed = {"__future__", "typing", "mixprec.errors", "matplotlib", "matplotlib.pyplot", "tqdm",
               "importlib.util", "collections.abc"}  # fmt: skip
    assert _imports(PACKAGE / "_optional.py") <= allowed
    # (torch itself imports tqdm; matplotlib is mixprec's to import, and only when plotting)
    code = "import sys, mixprec; print(sorted(m for m in sys.modules if m.startswith(" \
           "('mixprec.bench', 'mixprec.cli', 'matplotlib'))))"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
