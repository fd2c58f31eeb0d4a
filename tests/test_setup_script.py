"""scripts/setup.sh on a first run (issue 32): the Python version is checked before anything is installed (3.10+),
a newer ``python3.1x`` on the PATH is preferred when ``python3`` is too old (the Xcode tools' 3.9 on many Macs),
otherwise one line says how to get one; an Intel Mac (or a Rosetta shell) is told that MLX needs Apple silicon.
Run with a fake PATH of stub pythons, uname and sysctl (``--check-python`` stops after the checks)."""

import shutil
import subprocess

from conftest import REPO

TOOLS = ("bash", "sh", "dirname", "env", "id", "cat", "grep", "printf", "sed", "head", "tr")


def _setup(tmp_path, pythons: dict[str, str], system=("Linux", "x86_64"), translated="0", env=None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        path = shutil.which(tool)
        if path and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(path)
    stubs = dict(pythons)
    stubs["uname"] = f'case "$1" in -s) echo {system[0]};; -m) echo {system[1]};; *) echo {system[0]};; esac'
    stubs["sysctl"] = f"echo {translated}"
    for name, body in stubs.items():
        if name.startswith("python"):
            body = f'[ "$1" = -c ] && echo {body} && exit 0; exit 3'
        p = bin_dir / name
        p.write_text(f"#!/bin/sh\n{body}\n")
        p.chmod(0o755)
    e = {"PATH": str(bin_dir), "HOME": str(tmp_path), **(env or {})}
    return subprocess.run([str(bin_dir / "bash"), str(REPO / "scripts/setup.sh"), "--check-python"],
                          capture_output=True, text=True, env=e, timeout=60)


def test_a_new_enough_python3_is_used(tmp_path):
    r = _setup(tmp_path, {"python3": "3.11", "python3.12": "3.12"})
    assert r.returncode == 0 and r.stdout.strip().endswith("python3 (3.11)"), r.stderr


def test_a_newer_python3_1x_is_preferred_when_python3_is_too_old(tmp_path):
    r = _setup(tmp_path, {"python3": "3.9", "python3.10": "3.10", "python3.12": "3.12"})
    assert r.returncode == 0 and r.stdout.strip().endswith("python3.12 (3.12)"), (r.stdout, r.stderr)


def test_no_new_enough_python_says_how_to_get_one_in_one_line(tmp_path):
    r = _setup(tmp_path, {"python3": "3.9"}, system=("Darwin", "arm64"))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "3.10" in lines[0] and "3.9" in lines[0] and "brew install python" in lines[0], lines
    r = _setup(tmp_path, {"python3": "3.9"}, env={"PYTHON": str(tmp_path / "bin" / "python3")})
    assert r.returncode == 1 and "PYTHON=" in r.stderr and "3.9" in r.stderr


def test_an_intel_mac_and_a_rosetta_shell_are_told_mlx_needs_apple_silicon(tmp_path):
    r = _setup(tmp_path, {"python3": "3.11"}, system=("Darwin", "x86_64"))
    assert r.returncode == 1 and "Intel Mac" in r.stderr and "Apple silicon" in r.stderr, r.stderr
    r = _setup(tmp_path, {"python3": "3.11"}, system=("Darwin", "x86_64"), translated="1")
    assert r.returncode == 1 and "Rosetta" in r.stderr and "arm64" in r.stderr, r.stderr
    r = _setup(tmp_path, {"python3": "3.11"}, system=("Darwin", "arm64"))
    assert r.returncode == 0, r.stderr


def test_check_python_touches_nothing(tmp_path):
    before = sorted(p.name for p in REPO.iterdir())
    _setup(tmp_path, {"python3": "3.11"})
    assert sorted(p.name for p in REPO.iterdir()) == before
