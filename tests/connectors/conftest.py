"""One engine for the whole connectors package: the process-wide engine cache's default model, the same
one the map operator, the jobs and the examples pick up by themselves. Freed when the package is done."""

from __future__ import annotations

import pytest

from batchllm.connectors.engine_cache import clear_engine_cache, get_llm


@pytest.fixture(scope="package")
def llm():
    yield get_llm()
    clear_engine_cache()
