import pytest


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    """Run an engine test with and without asynchronous scheduling: the outputs must not differ."""
    return request.param
