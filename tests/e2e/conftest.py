import pytest


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    """Every engine of these tests is built with and without asynchronous scheduling; the references (HF
    transformers, caching off) do not change, so both must match them."""
    return request.param
