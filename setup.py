"""Package discovery. `kernels/` and `connectors/` live at the top level of the repo but install inside the
package, as `batchllm.kernels` and `batchllm.connectors`, so they cannot collide with other distributions'
top-level modules. Discovering every subpackage (instead of a hand list in pyproject.toml) keeps a new one
from being left out of the wheel; tests/test_packaging.py compares the wheel with the source tree."""

from setuptools import find_packages, setup

MAPPED = ("kernels", "connectors")
packages = find_packages(include=["batchllm", "batchllm.*"])
for top in MAPPED:
    packages += [f"batchllm.{name}" for name in find_packages(include=[top, f"{top}.*"])]

setup(packages=packages, package_dir={f"batchllm.{top}": top for top in MAPPED})
