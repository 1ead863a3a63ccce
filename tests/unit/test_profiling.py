"""The profiled step's shape (executor/profiling.py): it must carry the whole token budget, in sequences no
longer than the model allows, so the KV pool is sized with the largest step's activations set aside."""

import pytest

from batchllm.executor.profiling import profile_lengths


def test_one_long_sequence_carries_a_budget_within_max_model_len():
    lengths = profile_lengths(8192, 256, 8192)
    assert lengths[0] == 8192 - 255 and set(lengths[1:].tolist()) == {1} and len(lengths) == 256


def test_a_budget_above_max_model_len_is_spread_over_several_sequences():
    # 32768 tokens, 2048 per sequence at most: 256 rows of one token, 32512 more over rows of 2047 more each.
    lengths = profile_lengths(32768, 256, 2048).tolist()
    assert sum(lengths) == 32768 and max(lengths) == 2048
    assert lengths[:15] == [2048] * 15 and lengths[15] == 1 + 32512 - 15 * 2047 and set(lengths[16:]) == {1}


def test_a_budget_no_step_can_fill_stops_at_what_fits():
    assert profile_lengths(1000, 4, 100).tolist() == [100] * 4  # 4 rows of at most 100 tokens
    assert profile_lengths(3, 256, 100).tolist() == [1, 1, 1]  # fewer tokens than rows: one token each


def test_the_default_cpu_pool_holds_what_the_scheduler_can_use(tiny_llama_dir):
    """The default CPU budget (up to 4 GiB) would give the tiny model (8,192 bytes a block: K and V x 2 layers x 2
    heads x 16 dims x 16 tokens x 4 bytes) half a million blocks; it gets every sequence at full length twice over:
    2 x 4 sequences x 2048 / 16 = 1,024. A budget the user sets is taken as it is."""
    from batchllm import LLM

    assert LLM(tiny_llama_dir, device="cpu", max_num_seqs=4).stats.num_kv_blocks == 1024
    assert LLM(tiny_llama_dir, device="cpu", max_num_seqs=4,
               kv_cache_memory_bytes=3000 * 8192).stats.num_kv_blocks == 3000


def test_the_environment_bounds_the_default_cpu_pool(tiny_llama_dir, monkeypatch):
    """$BATCHLLM_CPU_KV_CACHE_BYTES replaces the default budget (500 blocks of 8,192 bytes, under the 1,024 that
    the scheduler could use); a value that is not a byte count is refused with the variable's name."""
    from batchllm import LLM

    monkeypatch.setenv("BATCHLLM_CPU_KV_CACHE_BYTES", str(500 * 8192))
    assert LLM(tiny_llama_dir, device="cpu", max_num_seqs=4).stats.num_kv_blocks == 500
    monkeypatch.setenv("BATCHLLM_CPU_KV_CACHE_BYTES", "4GiB")
    with pytest.raises(ValueError, match="BATCHLLM_CPU_KV_CACHE_BYTES='4GiB': expected a number of bytes"):
        LLM(tiny_llama_dir, device="cpu", max_num_seqs=4)


def test_the_dry_run_reports_the_pool_the_engine_takes(tiny_llama_dir):
    """The dry run's KV tokens (connectors/jobs/engine_preview.py, no model loaded) equal the engine's pool:
    1,024 blocks of 16 (the default budget's cap, as above), not the whole budget's blocks."""
    from batchllm import LLM
    from batchllm.connectors.jobs.engine_preview import preview_engine

    kwargs = dict(device="cpu", max_num_seqs=4)
    assert preview_engine(tiny_llama_dir, kwargs).kv_cache_tokens == 1024 * 16
    assert LLM(tiny_llama_dir, **kwargs).stats.num_kv_blocks == 1024
