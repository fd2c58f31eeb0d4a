"""core/ is pure Python + numpy: no array framework, no plotting, nothing above it in the package.

Two checks: importing every core module in a fresh interpreter loads no MLX, torch or matplotlib; and no import
statement anywhere in core (inside functions too, where a lazy import would slip past the first check) names
anything but the standard library, numpy (and tqdm), or another core module."""

import ast
import json
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import omnitide_mlx.core

CORE = Path(omnitide_mlx.core.__file__).parent
FORBIDDEN = ("mlx", "mlx_lm", "mlx_vlm", "torch", "matplotlib")
ALLOWED = {"numpy", "tqdm"}  # tqdm: the simulator's optional progress bar (a required, pure-Python dependency)

IMPORT_ALL = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import omnitide_mlx.core
    names = [m.name for m in pkgutil.walk_packages(omnitide_mlx.core.__path__, "omnitide_mlx.core.")]
    for name in names:
        importlib.import_module(name)
    print(json.dumps({"modules": names, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)}))
""")


def test_importing_core_loads_no_framework_and_no_matplotlib():
    code = f"FORBIDDEN = {FORBIDDEN!r}\n" + IMPORT_ALL
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "omnitide_mlx.core.sim" in out["modules"] and "omnitide_mlx.core.page" in out["modules"]
    assert out["loaded"] == []


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, 0, a.name
        elif isinstance(node, ast.ImportFrom):
            yield node.lineno, node.level, node.module or ""


def test_no_import_in_core_reaches_outside_stdlib_numpy_and_core():
    bad = []
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for line, level, module in _imports(path):
            top = module.split(".")[0]
            if level == 1 or (level == 0 and (top in sys.stdlib_module_names or top in ALLOWED)):
                continue
            if level == 0 and module.startswith("omnitide_mlx.core"):
                continue
            bad.append(f"{path.name}:{line}: {'.' * level}{module}")
    assert bad == [], f"core imports something outside stdlib / numpy / core: {bad}"


def test_every_core_module_is_checked():
    walked = {m.name.rsplit(".", 1)[-1] for m in pkgutil.walk_packages(omnitide_mlx.core.__path__)}
    assert walked == {p.stem for p in CORE.glob("*.py")} - {"__init__"}
