"""`kernels/` and `connectors/` must install as `batchllm.kernels` / `batchllm.connectors`, never as
top-level packages (they would collide with other distributions in site-packages). Checked for both a
built wheel and the editable install this test suite runs from."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAPPED = {"batchllm.kernels": REPO / "kernels", "batchllm.connectors": REPO / "connectors"}

# Run in a neutral directory: from the repo root, `import kernels` would succeed through the cwd entry.
IMPORT_CHECK = textwrap.dedent("""
    import importlib, importlib.util, json, sys
    found = {name: importlib.import_module(name).__file__ for name in sys.argv[1:]}
    found["top-level"] = [n for n in ("kernels", "connectors") if importlib.util.find_spec(n) is not None]
    print(json.dumps(found))
""")


def _imported_files(python: str, cwd: Path) -> dict:
    result = subprocess.run([python, "-c", IMPORT_CHECK, *MAPPED], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_editable_install_maps_kernels_and_connectors(tmp_path):
    found = _imported_files(sys.executable, tmp_path)
    # A stale editable install (made before the __init__.py files existed) imports these as namespace
    # packages with no __file__; `make venv` reinstalls when pyproject.toml changes.
    for name, directory in MAPPED.items():
        assert found[name] == str(directory / "__init__.py"), name
    assert found["top-level"] == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(REPO), "-w", str(out)],
                   check=True, timeout=600)
    (built,) = out.glob("batchllm-*.whl")
    return built


def test_wheel_has_no_top_level_kernels_or_connectors(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"batchllm"}
    assert {"batchllm/kernels/__init__.py", "batchllm/connectors/__init__.py"} <= names


def test_wheel_install_imports_kernels_and_connectors(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300)
    site = Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    # Dependencies (torch, transformers) come from this interpreter's site-packages through a .pth file.
    # The editable install's own .pth there is not processed, so `batchllm` resolves to the wheel's copy.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    found = _imported_files(python, tmp_path)
    for name in MAPPED:
        assert Path(found[name]).is_relative_to(site), (name, found[name])
    assert found["top-level"] == []
