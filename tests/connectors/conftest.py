"""One engine for the whole connectors package: the process-wide engine cache's default model, the same
one the map operator, the jobs and the examples pick up by themselves. Freed when the package is done."""

from __future__ import annotations

import pytest

from batchllm.connectors.engine_cache import clear_engine_cache, get_llm


@pytest.fixture(scope="package")
def llm():
    yield get_llm()
    clear_engine_cache()


@pytest.fixture(scope="module")
def keep_the_engine_cache():
    """For a module whose tests name another model (`model=`), which replaces the engine cache's one entry: the
    default model's engine (the `llm` fixture, which later tests patch and expect the doors to use) is put back."""
    from batchllm.connectors import engine_cache

    saved = engine_cache._cached
    yield
    engine_cache._cached = saved
