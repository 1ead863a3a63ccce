"""`objects_frozen` keeps pre-existing objects out of collections during a run and nothing out after it."""

from __future__ import annotations

import gc
import weakref

import pytest

from batchllm.host_gc import objects_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector can free it


@pytest.fixture(autouse=True)
def no_freeze():
    gc.collect()
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_objects_alive_at_the_start_are_frozen_for_the_run_only():
    node = _Node()
    alive = weakref.ref(node)
    with objects_frozen():
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert alive() is not None  # frozen: not collected during the run
        with objects_frozen():  # a second run (another thread's stream) shares the freeze
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None  # nothing is kept once the run is over


def test_garbage_made_during_the_run_is_collected_during_it():
    with objects_frozen():
        alive = weakref.ref(_Node())
        gc.collect()
        assert alive() is None


def test_a_process_that_froze_objects_itself_keeps_its_freeze():
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with objects_frozen():
            pass
        # Not unfrozen (0), not frozen again (more). Other threads alive in the test process (Ray's, servers')
        # may free a few frozen objects meanwhile, so the count may drop a little.
        assert 0.99 * count <= gc.get_freeze_count() <= count
    finally:
        gc.unfreeze()


def test_generation_runs_with_the_heap_frozen_and_leaves_it_unfrozen(tmp_path):
    from transformers import LlamaConfig

    from batchllm import LLM, SamplingParams
    from tests.unit.test_model_vs_hf import TINY, save_tiny_checkpoint

    save_tiny_checkpoint(LlamaConfig(**TINY), tmp_path)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, device="cpu")
    step, frozen = llm.engine.step, []

    def recording_step():
        frozen.append(gc.get_freeze_count() > 0)
        return step()

    llm.engine.step = recording_step
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert frozen and all(frozen)
    assert gc.get_freeze_count() == 0
    stream = llm.stream([("a", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))] * 2)
    next(stream)
    stream.close()  # a stream abandoned half way unfreezes too
    assert gc.get_freeze_count() == 0
