"""The profiled step's shape (executor/profiling.py): it must carry the whole token budget, in sequences no
longer than the model allows, so the KV pool is sized with the largest step's activations set aside."""

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
