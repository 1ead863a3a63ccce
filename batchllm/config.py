"""Engine-wide configuration, validated once when an `LLM` is built."""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("recompute", "swap")
ADMISSION_POLICIES = ("kv_aware", "optimistic")  # batchllm/engine/admission.py


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized from memory (GPU: profiled; CPU: kv_cache_memory_bytes)
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU budget for the KV pool; None picks a default
    enable_prefix_caching: bool = True
    swap_space: float = 0  # GiB of (pinned) host memory for KV blocks: swap space and the prefix cache's host tier
    # Sliding-window layers keep only the blocks their window sees (engine/kv_groups.py), where the rest allows.
    hybrid_kv_cache: bool = True

    def validate(self) -> None:
        _require(isinstance(self.block_size, int) and self.block_size > 0 and self.block_size % 8 == 0,
                 "block_size", self.block_size, "a positive multiple of 8")
        _require(self.num_blocks is None or (isinstance(self.num_blocks, int) and self.num_blocks >= 1),
                 "num_kv_blocks", self.num_blocks, "an int >= 1 or None")
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization,
                 "in (0, 1]")
        _require(isinstance(self.swap_space, (int, float)) and not isinstance(self.swap_space, bool)
                 and self.swap_space >= 0, "swap_space", self.swap_space, "a number of GiB >= 0")

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * (1 << 30))


DEFAULT_MAX_NUM_SEQS = 256  # where no calibration chooses (executor/calibration.py): the CPU, a hand-built config


# A burst's tokens reach the host (and a stream) together: past a few dozen the wait outweighs the host time saved.
MAX_DECODE_STEPS = 64


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0  # resolved from the model config and the KV pool size
    max_loras: int = 0  # distinct adapters among the running requests (device slots); 0: no LoRA
    preemption_mode: str = "recompute"  # "recompute" | "swap" (to the host tier, falling back to recompute)
    # Swap only requests with at least this much computed K/V: a shorter one is recomputed within a later step's
    # token budget, at less cost than two copies, each of which its step waits for.
    swap_min_tokens: int = 32
    # Pipeline parallelism: steps in flight at once, each with requests of its own (see engine_core.py).
    num_micro_batches: int = 1
    # "kv_aware": admit a request only when the pool holds it and the running ones to their expected ends;
    # "optimistic": whenever its prompt fits now (admission.py). EngineConfig (LLM, the CLI, the doors) defaults to
    # "kv_aware"; a SchedulerConfig built by hand keeps the old policy, which the scheduler's preemption tests drive.
    admission_policy: str = "optimistic"
    # Decode bursts (engine/decode_burst.py): a step of plain decode rows runs up to this many forward passes, each
    # sampling on the device the next one's input, and the host schedules and applies them once. 1: off.
    num_decode_steps: int = 1

    def validate(self) -> None:
        _require(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs",
                 self.max_num_seqs, "an int >= 1")
        _require(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
                 "max_num_batched_tokens", self.max_num_batched_tokens, "an int >= 1")
        _require(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", self.preemption_mode,
                 " or ".join(map(repr, PREEMPTION_MODES)))
        _require(self.admission_policy in ADMISSION_POLICIES, "admission_policy", self.admission_policy,
                 " or ".join(map(repr, ADMISSION_POLICIES)))
        _require(isinstance(self.num_micro_batches, int) and self.num_micro_batches >= 1, "pipeline_parallel_size",
                 self.num_micro_batches, "an int >= 1")
        _require(isinstance(self.num_decode_steps, int) and not isinstance(self.num_decode_steps, bool)
                 and 1 <= self.num_decode_steps <= MAX_DECODE_STEPS, "num_decode_steps", self.num_decode_steps,
                 f"an int in [1, {MAX_DECODE_STEPS}]")


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"LLM argument {name} must be {expected}, got {value!r}")


GENERATE_STEP_BUDGET = 8192  # tokens: a step's length delays every running row's next token
POOLING_STEP_BUDGET = 32768  # no row waits for a next token: larger steps spread the host's per-step work
# Decoder-layer parameters of a model whose 8192-token step covers the host's launch work on a Hopper GPU.
_LARGE_MODEL_PARAMETERS = 1_000_000_000


def default_step_budget(task: str, device_type: str, layer_parameters: int) -> int:
    """`max_num_batched_tokens` when the user gives none.

    Generating on CUDA, a small model's step is too short to hide the host's work of launching it: an eager
    prefill step of the smollm2-135m shape (8192 tokens) took ~15 ms of host launches for a few ms of GPU work on
    one H100, and W1 200 x 128 ran at 256k total tok/s with 8192-token steps against 290k with 32768 (same call,
    benchmarks/README.md "Host work per step"). So below 1B decoder-layer parameters the budget doubles per halving
    of the size, up to 4x (32768 tokens); on the CPU, where a step's compute dwarfs its launches, it stays 8192.
    """
    if task != "generate":
        return POOLING_STEP_BUDGET
    if device_type != "cuda":
        return GENERATE_STEP_BUDGET
    scale = 1
    while scale < 4 and layer_parameters * scale * 2 <= _LARGE_MODEL_PARAMETERS:
        scale *= 2
    return GENERATE_STEP_BUDGET * scale
