"""The built wheel carries every data file the package reads at run time.

Why a test: an editable install (``make setup``) reads data files from the source tree, so a file that
``[tool.setuptools.package-data]`` forgets works in every test run and is missing only for whoever
installs the wheel (``pip install .`` or from an index).  The oracle is the source tree itself: every
non-Python file under ``minivllm/`` must come back inside the wheel that setuptools builds from it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_every_package_data_file(tmp_path):
    src = tmp_path / "src"  # a copy, so the build's build/ and *.egg-info never touch the checkout
    shutil.copytree(ROOT / "minivllm", src / "minivllm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True)
    wheel, = (tmp_path / "dist").glob("minivllm-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    data = sorted(p.relative_to(src).as_posix() for p in (src / "minivllm").rglob("*")
                  if p.is_file() and p.suffix != ".py")
    assert data, "no data files under minivllm/: the test lost its oracle"
    missing = [p for p in data if p not in shipped]
    assert not missing, f"not in the wheel (add them to [tool.setuptools.package-data]): {missing}"
    # Apache-2.0 section 4(a): whoever receives the package receives the license with it
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in shipped), sorted(shipped)[-8:]
