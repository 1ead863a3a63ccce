"""Expert parallelism (`enable_expert_parallel=True`) end to end on the CPU: two gloo ranks, each holding half of
every MoE layer's experts whole, against HF transformers on the tiny checkpoints of tests/e2e/test_moe.py
(Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) and tests/e2e/test_gpt_oss.py (expert biases: the down
bias is added once per (token, expert) pair, by the expert's owner). Also: what each rank holds, the flag's
errors and no-ops, and the CLI flag. dispatch / combine alone: tests/distributed/test_expert_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig

from batchllm import LLM
from batchllm.distributed import parallel_state
from batchllm.entrypoints.cli.main import main
from batchllm.model.loader import load_model
from tests.connectors.jobs import write_parquet_input
from tests.connectors.test_cli import _run_job_arguments
from tests.distributed.test_tensor_parallel import write_checkpoint
from tests.e2e.test_gpt_oss import checkpoint  # noqa: F401 (a fixture)
from tests.e2e.test_moe import SHAPE, SPARSE_LAYERS, family  # noqa: F401 (a fixture)
from tests.e2e.test_sliding_window import ENGINE, _greedy, _prompts
from tests.unit.test_model_vs_hf import save_tiny_checkpoint

EXPERT_PARALLEL = dict(tensor_parallel_size=2, enable_expert_parallel=True)


def test_greedy_equals_hf_with_the_experts_split_over_two_ranks(family) -> None:  # noqa: F811
    """Each rank holds 2 of Mixtral's 4 experts (4 of the Qwen families' 8) with all their features; the tokens of
    each step travel to their experts' ranks and back. Qwen2-MoE's shared expert stays tensor-parallel."""
    llm = LLM(str(family.directory), enable_prefix_caching=False, **EXPERT_PARALLEL, **ENGINE)
    assert _greedy(llm, _prompts()) == family.expected
    llm.shutdown()


def test_gpt_oss_greedy_equals_hf_with_the_experts_split_over_two_ranks(checkpoint) -> None:  # noqa: F811
    llm = LLM(str(checkpoint.directory), enable_prefix_caching=False, max_num_batched_tokens=10,
              **EXPERT_PARALLEL, **ENGINE)  # chunked prefill: steps of 10 tokens, shares of 5
    assert _greedy(llm, _prompts()) == checkpoint.expected
    llm.shutdown()


@pytest.mark.parametrize("family", ["mixtral"], indirect=True)
def test_greedy_equals_hf_with_expert_parallel_stages(family) -> None:  # noqa: F811
    """PP=2 × TP=2 (four processes): each stage's two ranks form its expert-parallel group over its own layer."""
    llm = LLM(str(family.directory), enable_prefix_caching=False, pipeline_parallel_size=2, **EXPERT_PARALLEL,
              **ENGINE)
    assert _greedy(llm, _prompts()) == family.expected
    llm.shutdown()


def _load_as_rank(directory, rank: int, monkeypatch) -> torch.nn.Module:
    """The model rank `rank` of two builds and loads under expert parallelism (no process group is needed)."""
    monkeypatch.setattr(parallel_state, "_state", parallel_state.TensorParallel(rank, 2))
    monkeypatch.setattr(parallel_state, "_ep", parallel_state.ExpertParallel(rank, 2))
    model, _ = load_model(directory, "cpu", torch.float32)
    return model


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_only_its_experts_whole(family, rank, monkeypatch) -> None:  # noqa: F811
    """The memory point of expert parallelism: rank r's stacked experts are HF's experts [r * E/2, (r + 1) * E/2),
    every intermediate feature of each (HF's stacked `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`)."""
    model = _load_as_rank(family.directory, rank, monkeypatch)
    for layer in SPARSE_LAYERS[family.name]:
        ours, hf = model.model.layers[layer].mlp.experts, family.hf.model.layers[layer].mlp.experts
        half = hf.gate_up_proj.shape[0] // 2
        mine = slice(rank * half, (rank + 1) * half)
        assert ours.w13_weight.shape == (half, *hf.gate_up_proj.shape[1:])
        assert torch.equal(ours.w13_weight, hf.gate_up_proj[mine])
        assert torch.equal(ours.w2_weight, hf.down_proj[mine])


@pytest.mark.parametrize("rank", [0, 1])
def test_each_gpt_oss_rank_holds_its_experts_with_their_whole_down_bias(checkpoint, rank, monkeypatch) -> None:  # noqa: F811
    """gpt-oss's interleaved `gate_up_proj [E, H, 2I]` de-interleaved and transposed; the down bias whole on both
    ranks (under tensor parallelism only rank 0 keeps it: there the ranks' partial sums add up)."""
    model = _load_as_rank(checkpoint.directory, rank, monkeypatch)
    for ours_layer, hf_layer in zip(model.model.layers, checkpoint.hf.model.layers, strict=True):
        ours, hf = ours_layer.mlp.experts, hf_layer.mlp.experts
        mine = slice(rank * 2, rank * 2 + 2)
        gate_up, gate_up_bias = hf.gate_up_proj[mine], hf.gate_up_proj_bias[mine]
        assert ours.w13_weight.shape == (2, gate_up.shape[2], gate_up.shape[1])
        assert torch.equal(ours.w13_weight, torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], 2).transpose(1, 2))
        assert torch.equal(ours.w13_bias, torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], 1))
        assert torch.equal(ours.w2_weight, hf.down_proj[mine].transpose(1, 2))
        assert torch.equal(ours.w2_bias, hf.down_proj_bias[mine])


def test_experts_that_do_not_divide_over_the_ranks_are_refused(tmp_path) -> None:
    """Before any worker process starts; without the flag the same model splits each expert instead."""
    save_tiny_checkpoint(MixtralConfig(**SHAPE, intermediate_size=32, num_hidden_layers=1, num_local_experts=3),
                         tmp_path)
    with pytest.raises(ValueError, match=r"enable_expert_parallel=True places each MoE layer's 3 experts whole on "
                                         r"the tensor_parallel_size=2 ranks, but 3 is not divisible by 2"):
        LLM(str(tmp_path), **EXPERT_PARALLEL, **ENGINE)
    with pytest.raises(ValueError, match="enable_expert_parallel must be True or False, got 'yes'"):
        LLM(str(tmp_path), enable_expert_parallel="yes", **ENGINE)


def test_on_a_model_without_experts_the_flag_changes_nothing(tmp_path) -> None:
    """A dense model under TP=2 with the flag: no error, and the tokens of the same engine without it."""
    dense = write_checkpoint(tmp_path, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    with_flag = LLM(str(dense), **EXPERT_PARALLEL, **ENGINE)
    tokens = _greedy(with_flag, _prompts())
    with_flag.shutdown()
    assert tokens == _greedy(LLM(str(dense), **ENGINE), _prompts())


@pytest.mark.parametrize("family", ["qwen2-moe"], indirect=True)
def test_without_tensor_parallelism_the_flag_changes_nothing(family) -> None:  # noqa: F811
    llm = LLM(str(family.directory), enable_expert_parallel=True, **ENGINE)
    assert llm.runner.model.model.layers[0].mlp.experts.local_experts == range(8)
    assert _greedy(llm, _prompts()) == family.expected


def test_the_cli_flag_reaches_the_engine(monkeypatch, tmp_path, capsys) -> None:
    options = _run_job_arguments(monkeypatch, "--tensor-parallel-size", "2", "--enable-expert-parallel")
    assert options["engine_kwargs"] == {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    assert _run_job_arguments(monkeypatch)["engine_kwargs"] is None
    for command in ("run", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--enable-expert-parallel" in capsys.readouterr().out


def test_the_cli_names_the_flags_when_the_experts_do_not_divide(tmp_path, capsys) -> None:
    save_tiny_checkpoint(MixtralConfig(**SHAPE, intermediate_size=32, num_hidden_layers=1, num_local_experts=3),
                         tmp_path / "model")
    write_parquet_input(tmp_path / "in", [2])
    assert main(["run", str(tmp_path / "in"), str(tmp_path / "out"), "--prompt-column", "q", "--model",
                 str(tmp_path / "model"), "--tensor-parallel-size", "2", "--enable-expert-parallel"]) == 2
    assert ("--enable-expert-parallel places each MoE layer's 3 experts whole on the --tensor-parallel-size 2 ranks"
            in capsys.readouterr().err)
