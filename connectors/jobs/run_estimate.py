"""A rough estimate of a job's run time from the model's size and the machine, made before anything runs.

Roofline-style: an engine step costs the larger of its arithmetic at the device's matmul rate and its memory
traffic at the device's bandwidth, plus the host's work for the step and for each sequence in it (the host
and the device are not assumed to overlap). What it assumes:

- Size: the parameter count follows from config.json (`model_size`, equal to what the checkpoint holds);
  no weight is read. Linear weights (a MoE model's experts included) sit on the device at `linear_weight_bits`
  (FP8: 8, 4-bit checkpoints on a GPU: 4), but MXFP4 experts at 4.25 bits (their scales included), the rest
  (norms, biases, routers, embeddings) at the run's dtype.
- Prefill: 2 FLOPs per active decoder-layer weight (of a MoE model's experts, the top-k) per prompt token,
  causal attention 2 * layers * q_dim * L^2 per prompt of L tokens, the LM head once per prompt; steps of
  max_num_batched_tokens each read the weights once.
- Decode: min(max_num_seqs, sequences, sequences the KV pool holds at their mean length) run at once, every
  step reading all weights and each sequence's K/V, 2 FLOPs per active matmul weight and 4 * layers * q_dim per
  context token per sequence. Every sequence generates all its max_tokens: an upper bound (EOS stops most
  rows earlier). Prefill and decode are added, not overlapped; pooling tasks (embed, classify) only prefill.
- GPUs: the data-sheet peaks below (dense bf16 / fp16 tensor FLOP/s, memory bandwidth), of which 50 % and
  60 % are reached; float32 computes at 1/16 of the bf16 rate (no tensor cores: TF32 is off). A card not in the
  table counts as 100 TFLOP/s and 1 TB/s. Host work: 1 ms per step and 10 µs per running sequence (the host
  profile of benchmarks/README.md). data_parallel × tensor × pipeline GPUs share the work evenly (optimistic).
- CPU: 100 GFLOP/s per torch thread and 20 GB/s for the weights, but 1.5 GB/s for the K/V a step reads (the CPU
  path's reference attention gathers and converts it), 5 ms of host work per step and 2 ms per running sequence:
  fitted to the default model on the project's 2-core machine (W1 32 × 64 in benchmarks/README.md: 308 total
  tok/s measured, 311 estimated). Data-parallel replicas share the same cores, so they do not divide the time.
- Checked against benchmarks/README.md's H200 figures: W1 1000 × 256 on the llama3-8b shape 24.8k total tok/s
  estimated, 27.4-28.7k measured; W1 200 × 128 27.5k estimated, 40.7k measured; smollm2-135m W1 200 × 128
  225k estimated, 215-250k measured.
- Not counted: loading the model, tokenizing the input, writing the output.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from batchllm.model.config import ModelConfig
from batchllm.model.size import ModelSize, model_size

# (name fragment, dense bf16 TFLOP/s, memory TB/s), from NVIDIA's data sheets; the first fragment in the card's
# name wins, so more specific names come first.
GPU_PEAKS = (("H200", 989, 4.8), ("H100 PCIe", 756, 2.0), ("H100", 989, 3.35), ("A100", 312, 2.0),
             ("L40S", 362, 0.864), ("L4", 121, 0.3), ("A10", 125, 0.6))
_UNKNOWN_GPU = (100, 1.0)
_GPU = {"flops_share": 0.5, "bandwidth_share": 0.6, "step_seconds": 1e-3, "sequence_seconds": 10e-6}
_CPU = {"flops_per_thread": 100e9, "bandwidth": 20e9, "kv_bandwidth": 1.5e9, "step_seconds": 5e-3,
        "sequence_seconds": 2e-3}
_FLOAT32_SLOWDOWN = 16


@dataclass(slots=True)
class Workload:
    """The rows that would reach the engine: their prompt lengths and their most output tokens."""

    prompts: int = 0
    prompt_tokens: int = 0
    prompt_tokens_squared: int = 0  # sum of L^2: causal attention's prefill cost
    sequences: int = 0  # prompts × n
    output_tokens: int = 0  # every sequence running to its max_tokens

    def add(self, prompt_tokens: int, samples: int, max_output_tokens: int) -> None:
        self.prompts += 1
        self.prompt_tokens += prompt_tokens
        self.prompt_tokens_squared += prompt_tokens * prompt_tokens
        self.sequences += samples
        self.output_tokens += samples * max_output_tokens


@dataclass(frozen=True, slots=True)
class Machine:
    description: str
    flops: float  # FLOP/s one device reaches, at the run's dtype
    bandwidth: float  # bytes/s of weights read
    kv_bandwidth: float  # bytes/s of K/V read by attention
    step_seconds: float  # host work per engine step
    sequence_seconds: float  # host work per sequence in a step
    devices: int  # devices sharing the work


def machine_for(engine: Any, data_parallel_size: int) -> Machine:
    """The machine the run would use: `engine.device_type` decides CPU vs CUDA (as a run resolves `--device`)."""
    if engine.device_type == "cpu":
        import torch

        threads = torch.get_num_threads()
        return Machine(f"CPU, {threads} torch thread{'s' * (threads > 1)}", _CPU["flops_per_thread"] * threads,
                       _CPU["bandwidth"], _CPU["kv_bandwidth"], _CPU["step_seconds"], _CPU["sequence_seconds"], 1)
    name = gpu_name()
    tflops, terabytes = next(((t, b) for fragment, t, b in GPU_PEAKS if name and fragment in name), _UNKNOWN_GPU)
    flops = tflops * 1e12 * _GPU["flops_share"] / (_FLOAT32_SLOWDOWN if engine.dtype_bytes == 4 else 1)
    devices = data_parallel_size * engine.gpus_per_replica
    known = name is not None and any(fragment in name for fragment, _, _ in GPU_PEAKS)
    description = f"{devices} × {name or 'CUDA GPU'}" + ("" if known else " (not in the table: assumed 100 TFLOP/s, "
                                                                          "1 TB/s)")
    bandwidth = terabytes * 1e12 * _GPU["bandwidth_share"]
    return Machine(description, flops, bandwidth, bandwidth, _GPU["step_seconds"], _GPU["sequence_seconds"], devices)


def gpu_name() -> str | None:
    """The first visible GPU's name, asked of nvidia-smi (NVML): no CUDA context is created in this process."""
    if shutil.which("nvidia-smi") is None:
        return None
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    try:
        listing = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader",
                                  *(["-i", first] if first else [])], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = listing.stdout.strip().splitlines()
    return lines[0].strip() if listing.returncode == 0 and lines else None


@dataclass(frozen=True, slots=True)
class Estimate:
    prefill_seconds: float
    decode_seconds: float
    concurrency: int  # sequences decoding at once
    machine: Machine

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds


def weight_bytes(size: ModelSize, engine: Any) -> float:
    """The bytes of every weight `engine` (an `EnginePreview`) holds: the linear weights (experts included) at its
    `linear_weight_bits`, the rest at its dtype. Scales are left out (one float32 per row or group: a few in a
    thousand of an FP8 or 4-bit weight at real widths), but for MXFP4 experts' (`expert_weight_bits`)."""
    return _linear_bytes(size, engine) + (size.parameters - size.linear) * engine.dtype_bytes


def _linear_bytes(size: ModelSize, engine: Any) -> float:
    """The linear weights' bytes: MoE experts at the engine's `expert_weight_bits` (MXFP4: 4.25, its E8M0 scale
    per 32 weights included; else the other linears' width), which a model without experts need not say."""
    experts = size.experts * engine.expert_weight_bits / 8 if size.experts else 0
    return (size.linear - size.experts) * engine.linear_weight_bits / 8 + experts


def estimate_run(work: Workload, engine: Any, machine: Machine) -> Estimate:
    """The run time of `work` on `engine` (an `EnginePreview`) and `machine`; see the module docstring."""
    config: ModelConfig = engine.model_config
    size = model_size(config)
    pools = engine.pooling_params is not None
    head = 0 if pools else size.head  # a pooled row stops at the hidden states (a classifier's head is tiny)
    weight_bytes = _linear_bytes(size, engine) + (size.layers - size.linear + head) * engine.dtype_bytes
    q_dim = config.num_heads * config.head_dim
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * (
        1 if engine.kv_cache_dtype == "fp8" else engine.dtype_bytes)

    def step(flops: float, weights_read: float, kv_read: float, sequences: int) -> float:
        memory = weights_read / machine.bandwidth + kv_read / machine.kv_bandwidth
        return max(flops / machine.flops, memory) + machine.step_seconds + sequences * machine.sequence_seconds

    prefill_steps = math.ceil(work.prompt_tokens / engine.max_num_batched_tokens)
    prefill = 0.0
    if prefill_steps:
        flops = (2 * size.active * work.prompt_tokens + 2 * config.num_layers * q_dim * work.prompt_tokens_squared
                 + 2 * head * work.prompts)
        # One roofline over all prefill steps; each step's own host work on top.
        prefill = (step(flops, prefill_steps * weight_bytes, 0, work.prompts)
                   + (prefill_steps - 1) * machine.step_seconds)
    decode, concurrency = 0.0, 0
    if work.output_tokens and not pools:
        mean_prompt = work.prompt_tokens / work.prompts
        mean_output = work.output_tokens / work.sequences
        concurrency = min(engine.max_num_seqs, work.sequences)
        if engine.kv_cache_tokens is not None:
            concurrency = max(1, min(concurrency, int(engine.kv_cache_tokens // (mean_prompt + mean_output))))
        context = mean_prompt + mean_output / 2
        flops = concurrency * (2 * (size.active + head) + 4 * config.num_layers * q_dim * context)
        kv_read = concurrency * context * kv_bytes_per_token
        decode = math.ceil(work.output_tokens / concurrency) * step(flops, weight_bytes, kv_read, concurrency)
    return Estimate(prefill / machine.devices, decode / machine.devices, concurrency, machine)
