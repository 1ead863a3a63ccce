import pytest


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def async_scheduling(request) -> bool:
    """Every engine of these tests is built with and without asynchronous scheduling; the references (HF
    transformers, caching off) do not change, so both must match them."""
    return request.param


@pytest.fixture(scope="module")
def model_path():
    """The default model's directory: the HF references load it without an engine, so they are computed once
    per module, not once per scheduling mode."""
    from batchllm.model.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from batchllm.tokenizer import load_tokenizer

    return load_tokenizer(model_path)
