"""The suite imports the code as users do, with the repo root off sys.path. The root holds kernels/ (installed as
`batchllm.kernels`); on sys.path it would also be the top-level `kernels`, which is HF's package, imported by
transformers >= 5.25. pytest runs in importlib mode (pyproject.toml), which leaves sys.path alone; `python -m
pytest` from the root puts the root there, and tests/conftest.py takes it off. Without either, these fail."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_repo_root_is_not_on_sys_path():
    # An empty entry stands for the cwd (`python -m`, `python -c`).
    entries = [entry for entry in sys.path if Path(entry or os.getcwd()).resolve() == REPO]
    assert entries == [], "run pytest as `make test` does (.venv/bin/pytest), in importlib mode"


def test_the_top_level_kernels_is_not_the_repo_folder():
    spec = importlib.util.find_spec("kernels")
    places = [] if spec is None else [spec.origin, *(spec.submodule_search_locations or [])]
    # .venv lives in the repo too: only the repo's own folder is wrong.
    assert [place for place in places if place and Path(place).resolve().is_relative_to(REPO / "kernels")] == []


def test_transformers_imports_hf_kernels():
    try:
        distribution = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("HF's kernels is not installed (transformers < 5.25 does not require it)")
    import transformers.activations  # noqa: F401  (transformers >= 5.25 imports `kernels` here, via hub_kernels)

    kernels = importlib.import_module("kernels")
    assert Path(kernels.__file__).resolve() == Path(distribution.locate_file("kernels/__init__.py")).resolve()
