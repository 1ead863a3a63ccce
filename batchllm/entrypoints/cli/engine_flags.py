"""The engine flags and the error conventions that `batchllm run` and `batchllm serve` share.

Errors name the flags (`--max-num-seqs`), not the Python arguments behind them, and exit with status 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, NoReturn

from batchllm.config import ADMISSION_POLICIES, PREEMPTION_MODES
from batchllm.engine.structured.manager import GRAMMAR_BACKENDS
from batchllm.engine_config import DEFAULTS
from batchllm.entrypoints.cli.types import disaggregated_layout, speculative_config
from batchllm.model.quantization import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from batchllm.pooling_params import POOLING_TYPES, TASKS
from batchllm.reasoning import REASONING_PARSERS

ENGINE_FLAGS = {"device": str, "dtype": str, "max_model_len": int, "max_num_seqs": int,
                "max_num_batched_tokens": int, "gpu_memory_utilization": float, "tensor_parallel_size": int,
                "pipeline_parallel_size": int, "max_loras": int, "max_lora_rank": int, "num_kv_blocks": int,
                "swap_space": float, "num_decode_steps": int}
# The engine flags that are not plain typed values (choices, JSON).
OTHER_ENGINE_FLAGS = ("load_format", "structured_outputs_backend", "quantization", "kv_cache_dtype",
                      "speculative_config", "preemption_mode", "admission_policy", "disaggregated", "task", "pooling",
                      "normalize", "disable_hybrid_kv_cache_manager", "reasoning_parser", "enable_expert_parallel",
                      "deterministic")
USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError, IsADirectoryError)
ENGINE_DEFAULTS = DEFAULTS  # LLM(...)'s keywords and defaults, as EngineConfig.from_kwargs applies them
ENGINE_HELP = {"max_model_len": "max_model_len (None: the model's context length)",
               "max_num_seqs": "sequences a step runs at most (None: 256 on the CPU; on a GPU, chosen by timing a "
                               "few decode steps at start)",
               "max_num_batched_tokens": "tokens a step computes at most (None: on a GPU, chosen by timing prefill "
                                         "steps at start; else 8192, more for a small model or a pooling task)",
               "max_loras": "adapters on the device at once (with --lora)", "max_lora_rank": "highest adapter rank",
               "num_kv_blocks": "KV-cache blocks on the device (None: sized from free memory)",
               "swap_space": "GiB of host memory for KV blocks: the prefix cache's host tier, and swap space for "
                             "--preemption-mode swap (0: off)",
               "num_decode_steps": "decode forward passes one step runs while every row is a plain decode row "
                                   "(1: off); the host's per-step work is then spread over that many tokens"}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """`--device`, `--max-model-len`, ..., `--speculative-config`; `engine_options(args)` reads them back."""
    for name, kind in ENGINE_FLAGS.items():
        parser.add_argument(flag(name), type=kind, default=ENGINE_DEFAULTS[name],
                            help=f"engine: {ENGINE_HELP.get(name, name)}")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        default=ENGINE_DEFAULTS["enable_expert_parallel"],
                        help="engine: with --tensor-parallel-size N, place each MoE layer's experts whole on the N "
                             "ranks (an all-to-all of tokens) instead of a slice of every expert on each")
    parser.add_argument("--deterministic", action="store_true", default=ENGINE_DEFAULTS["deterministic"],
                        help="engine: each row's tokens and logprobs bit-identical whatever else is in the batch, the "
                             "step budget, prefix caching or the replicas (on CUDA: bfloat16/float16, no tensor "
                             "parallelism)")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default=ENGINE_DEFAULTS["load_format"],
                        help="engine: the checkpoint's weights, or random ones of its shapes (dummy)")
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, default=ENGINE_DEFAULTS["quantization"],
                        help="engine: quantize the weights on load (fp8: E4M3 with per-channel scales; mxfp4: a "
                             "MoE model's experts only, E2M1 in blocks of 32), or name a quantized checkpoint's "
                             "format (gptq, awq, compressed-tensors; FP8, integer and MXFP4 checkpoints are "
                             "detected without it)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=ENGINE_DEFAULTS["kv_cache_dtype"],
                        help="engine: the KV cache's dtype (auto: the model's; fp8: E4M3, twice the tokens)")
    parser.add_argument("--structured-outputs-backend", choices=tuple(GRAMMAR_BACKENDS),
                        default=ENGINE_DEFAULTS["structured_outputs_backend"],
                        help="engine: the grammar engine of structured outputs (llguidance: compiles schemas 10-20x "
                             "faster, for many distinct --schema-column schemas)")
    parser.add_argument("--preemption-mode", choices=PREEMPTION_MODES, default=ENGINE_DEFAULTS["preemption_mode"],
                        help="engine: what a preempted request's K/V does: recompute, or swap to --swap-space and back")
    parser.add_argument("--admission-policy", choices=ADMISSION_POLICIES, default=ENGINE_DEFAULTS["admission_policy"],
                        help="engine: kv_aware admits a row only when the KV pool holds it to its expected end "
                             "(max_tokens if forced, else learned from finished rows); optimistic admits whenever the "
                             "prompt fits and preempts (recomputing) when the pool runs dry")
    parser.add_argument("--speculative-config", type=speculative_config, metavar="JSON",
                        default=ENGINE_DEFAULTS["speculative_config"],
                        help='engine: speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                             '(vLLM\'s keys; outputs keep the model\'s distribution, greedy ones are unchanged)')
    parser.add_argument("--task", choices=TASKS, default=ENGINE_DEFAULTS["task"],
                        help="engine: generate, or embed (a vector per row: the `embedding` column), classify (a "
                             "*ForSequenceClassification model's logits), score")
    parser.add_argument("--pooling", choices=POOLING_TYPES, default=ENGINE_DEFAULTS["pooling"],
                        help="engine (--task embed): pool the last token's, the mean of every token's or the first "
                             "token's final hidden state (default: what the model directory says, else last)")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=ENGINE_DEFAULTS["normalize"],
                        help="engine (--task embed): normalize vectors to unit length (default: what the model "
                             "directory says, else yes)")
    parser.add_argument("--disaggregated", type=disaggregated_layout, metavar="JSON",
                        default=ENGINE_DEFAULTS["disaggregated"],
                        help='engine: a prefill engine hands each prompt\'s K/V to a decode engine, each on its own '
                             'GPU (or process), e.g. \'{"prefill": 1, "decode": 1}\'')
    parser.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                        default=ENGINE_DEFAULTS["disable_hybrid_kv_cache_manager"],
                        help="engine: keep every block of sliding-window layers (by default a model with window "
                             "layers, e.g. Gemma, keeps only the blocks each window still sees)")
    parser.add_argument("--reasoning-parser", choices=tuple(REASONING_PARSERS),
                        default=ENGINE_DEFAULTS["reasoning_parser"],
                        help="engine: split a thinking model's output into its reasoning (a `reasoning` column, the "
                             "server's `reasoning_content`) and the answer")


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose own errors (a flag's bad value, flags that exclude each other) read as the commands' other
    errors: one line, `batchllm: error: ...`, status 2. The usage is for --help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"batchllm: error: {message}\n")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM arguments the engine flags set: only what differs from LLM's defaults, so the engine equals (and is
    cached as) a plain LLM() otherwise."""
    return {name: getattr(args, name) for name in (*ENGINE_FLAGS, *OTHER_ENGINE_FLAGS)
            if getattr(args, name) != ENGINE_DEFAULTS[name]}


def fail(message: str) -> int:
    print(f"batchllm: error: {message}", file=sys.stderr)
    return 2


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def flags_by_python_name(parser: argparse.ArgumentParser, python_names: dict[str, str] | None = None
                         ) -> dict[str, str]:
    """Flag by Python argument name; `python_names` maps the Python names that differ from a flag's dest to it."""
    flags = {action.dest: action.option_strings[0] for action in parser._actions
             if action.option_strings and action.dest != "help"}
    return {**flags, **{python: flags[dest] for python, dest in (python_names or {}).items()}}


def with_flag_names(message: str, flags: dict[str, str]) -> str:
    """`message` with the Python names of options replaced by their flags: `rows_per_shard` → `--rows-per-shard`,
    `SamplingParams.top_p` → `--top-p`, `chat=True` → `--chat`, `max_tokens=300` → `--max-tokens 300`.

    A name without an underscore ("model", "seed") counts only where it is plainly an argument (after
    `SamplingParams.` / `LLM argument`, or before `=`): elsewhere it is an ordinary word. Quoted names are
    values (column names), and dotted ones manifest keys; both stay as they are.
    """
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.'-])(?P<owner>SamplingParams\.|LLM argument )?(?P<name>{names})(?![\w'])"
                         rf"(?P<assign>=True\b|=(?P<value>(?=[^\s,;)]))?)?")

    def flag_of(match: re.Match) -> str:
        if not (match["owner"] or match["assign"] or "_" in match["name"]):
            return match[0]
        return flags[match["name"]] + (" " if match["value"] is not None else "")

    return pattern.sub(flag_of, message)
