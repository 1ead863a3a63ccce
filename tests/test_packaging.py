"""The wheel is what users install: it must hold every package of the source tree, work on its own in a
fresh virtual environment, and install `kernels/` and `connectors/` as `batchllm.kernels` /
`batchllm.connectors`, never as top-level packages (they would collide with other distributions in
site-packages). The editable install this suite runs from is checked for the same mapping."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAPPED = {"batchllm.kernels": REPO / "kernels", "batchllm.connectors": REPO / "connectors"}

# Run in a neutral directory: from the repo root, `import kernels` would find the folder through the cwd entry.
# "top-level": where `kernels` / `connectors` import from, if at all (HF's `kernels`, which transformers >= 5.25
# requires, is one; ours must never be).
IMPORT_CHECK = textwrap.dedent("""
    import importlib, importlib.util, json, sys
    found = {name: importlib.import_module(name).__file__ for name in sys.argv[1:]}
    specs = {name: importlib.util.find_spec(name) for name in ("kernels", "connectors")}
    found["top-level"] = [place for spec in specs.values() if spec
                          for place in (spec.submodule_search_locations or [spec.origin])]
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
    assert [place for place in found["top-level"] if Path(place).resolve() in MAPPED.values()] == []


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy of the tree without build/: setuptools reuses a stale build/lib, whose leftovers
    # would hide a package that the current configuration leaves out.
    source = tmp_path_factory.mktemp("source") / "batchllm"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info",
                                                                "__pycache__", ".pytest_cache"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source),
                    "-w", str(out)], check=True, timeout=600)
    (built,) = out.glob("batchllm-*.whl")
    return built


def test_wheel_has_no_top_level_kernels_or_connectors(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"batchllm"}
    assert {"batchllm/kernels/__init__.py", "batchllm/connectors/__init__.py"} <= names


def _source_packages() -> dict[str, Path]:
    """Every package of the source tree: the name it installs under → its directory."""
    packages = {}
    for init in REPO.rglob("__init__.py"):
        parts = init.parent.relative_to(REPO).parts
        if parts and parts[0] in ("batchllm", "kernels", "connectors"):
            name = ".".join(parts)
            packages[name if parts[0] == "batchllm" else f"batchllm.{name}"] = init.parent
    return packages


def test_wheel_holds_every_module_of_the_source_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = _source_packages()
    assert {"batchllm.distributed", "batchllm.connectors.jobs"} <= set(packages)  # the walk itself works
    missing = [f"{name}.{source.stem}" for name, directory in packages.items() for source in directory.glob("*.py")
               if f"{name.replace('.', '/')}/{source.name}" not in names]
    assert missing == []


@pytest.fixture(scope="module")
def wheel_python(wheel, tmp_path_factory) -> str:
    """A fresh virtual environment outside the repo with only the wheel installed as batchllm.

    Dependencies (torch, transformers, ...) come from this interpreter's site-packages through a .pth file;
    `.pth` files inside that directory (the editable install's finder among them) are not processed, so
    nothing fills in a subpackage that the wheel lacks."""
    venv = tmp_path_factory.mktemp("wheel-env") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300)
    site = Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    # Dependencies (torch, transformers) come from this interpreter's site-packages through a .pth file.
    # The editable install's own .pth there is not processed, so `batchllm` resolves to the wheel's copy.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_wheel_install_imports_kernels_and_connectors(wheel_python, tmp_path):
    site = Path(subprocess.check_output(
        [wheel_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    found = _imported_files(wheel_python, tmp_path)
    for name in MAPPED:
        assert Path(found[name]).is_relative_to(site), (name, found[name])
    assert [place for place in found["top-level"] if Path(place).is_relative_to(site)] == []


# Builds engines from the wheel alone: one in-process, one over three tensor-parallel worker processes
# (they import the wheel's batchllm.distributed and executor modules in fresh interpreters).
ENGINE_CHECK = textwrap.dedent("""
    import gc, json, sys
    import batchllm
    from batchllm import LLM, SamplingParams
    texts = []
    if __name__ == "__main__":
        params = SamplingParams(max_tokens=3, temperature=0)
        for tp in (1, 3):
            llm = LLM(device="cpu", tensor_parallel_size=tp)
            texts.append(llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text)
            llm.shutdown()
            del llm  # its KV pool goes before the next engine takes one (a memory-tight machine holds one at a time)
            gc.collect()
        print(json.dumps({"file": batchllm.__file__, "texts": texts}))
""")


@pytest.mark.slow
def test_wheel_builds_an_llm_in_a_fresh_environment(wheel_python, tmp_path):
    script = tmp_path / "engine_check.py"
    script.write_text(ENGINE_CHECK)
    result = subprocess.run([wheel_python, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert not Path(found["file"]).is_relative_to(REPO), found["file"]
    one_process, three_ranks = found["texts"]
    assert one_process and one_process == three_ranks
