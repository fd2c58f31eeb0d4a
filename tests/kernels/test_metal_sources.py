"""The Metal sources live in the repository's top-level ``metal/`` folder (the checker's headers in ``metal/checker/``)
and the package finds them: in a checkout through ``omnitide_mlx/kernels/metal`` (a symlink), installed through the
copy the wheel ships (pyproject.toml package-data). A wheel built from the files a fresh clone has must carry them."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from omnitide_mlx.kernels.attention import metal_source

ROOT = Path(__file__).resolve().parents[2]
METAL = ROOT / "metal"
KERNELS = ("tile_skip_attention", "tile_skip_attention_q", "page_compact")
HEADERS = ("metal_shim.h", "metal_emu.h")


def test_the_sources_and_headers_live_in_the_top_level_folder_and_the_package_reads_them():
    assert sorted(p.stem for p in METAL.glob("*.metal")) == sorted(KERNELS)
    assert sorted(p.name for p in (METAL / "checker").glob("*.h")) == sorted(HEADERS)
    for name in KERNELS:
        assert metal_source(name) == (METAL / f"{name}.metal").read_text()
    link = ROOT / "omnitide_mlx" / "kernels" / "metal"
    assert link.is_symlink() and link.resolve() == METAL.resolve()


def _clone_files(dest: Path) -> None:
    """The files a fresh clone of this working tree has (tracked and untracked-not-ignored), symlinks kept."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    for rel in sorted({r for r in out.decode().split("\0") if r}):
        src, dst = ROOT / rel, dest / rel
        if not src.is_symlink() and not src.exists():  # deleted in the working tree, not yet committed
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)


def test_a_wheel_built_from_a_fresh_clone_ships_the_sources_and_the_kernels_find_them(tmp_path):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    clone, dist = tmp_path / "clone", tmp_path / "dist"
    _clone_files(clone)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(dist), str(clone)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = dist.glob("omnitide_mlx-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        z.extractall(site)
    for name in KERNELS:
        assert f"omnitide_mlx/kernels/metal/{name}.metal" in names
    for name in HEADERS:
        assert f"omnitide_mlx/kernels/metal/checker/{name}" in names
    # the installed package (no checkout around it) reads its own copy
    code = ("import json, sys; from omnitide_mlx.kernels import attention as a; "
            f"print(json.dumps({{'file': a.__file__, 'src': {{n: a.metal_source(n) for n in {KERNELS!r}}}}}))")
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(out["file"]).resolve().is_relative_to(site.resolve())
    assert out["src"] == {n: (METAL / f"{n}.metal").read_text() for n in KERNELS}
