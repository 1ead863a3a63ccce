"""The `batchllm` command (also `python -m batchllm`).

    batchllm run INPUT OUTPUT --prompt-column question --max-tokens 128 --temperature 0

Exit status: 0 done; 2 bad arguments or options (nothing generated); 128 + N after signal N (SIGINT:
130, SIGTERM: 143) with every completed shard saved: run the same command again to resume; 1 when every
data-parallel replica died (completed shards saved, resumable too).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from typing import Any

# Sampling flags → SamplingParams fields; only flags given on the command line are passed on.
_SAMPLING_FLAGS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
                   "seed": int, "n": int, "min_tokens": int, "presence_penalty": float,
                   "frequency_penalty": float, "repetition_penalty": float, "logprobs": int}
_ENGINE_FLAGS = {"device": str, "dtype": str, "max_model_len": int, "max_num_seqs": int,
                 "max_num_batched_tokens": int, "gpu_memory_utilization": float, "tensor_parallel_size": int}
_USAGE_ERRORS = (ValueError, TypeError, FileNotFoundError, FileExistsError, IsADirectoryError)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    return _run(args, argv)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchllm", description="Offline LLM batch inference.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run", help="generate for every row of a Parquet input or an OpenAI batch JSONL file (resumable)",
        description="Parquet file / directory / glob → a directory of Parquet shards; OpenAI batch *.jsonl → a "
                    "response *.jsonl. Re-running the same command resumes an interrupted job.")
    run.add_argument("input", help="Parquet file, directory or glob; or an OpenAI batch request file (*.jsonl)")
    run.add_argument("output", help="output directory (Parquet input) or output .jsonl file (JSONL input)")
    prompt = run.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-column", help="column holding the prompt text")
    prompt.add_argument("--messages-column", help="column holding chat messages (a list of {role, content})")
    prompt.add_argument("--template", help="str.format template over the row's columns, e.g. 'Q: {question}'")
    run.add_argument("--chat", action="store_true", help="send the prompt text as a user message through the "
                                                         "model's chat template")
    run.add_argument("--output-column", default="generated_text", help="name of the generated-text column")
    run.add_argument("--truncate", choices=("error", "left", "right"), default="error",
                     help="what to do with a prompt that leaves no room for --max-tokens (default: error the row)")
    run.add_argument("--model", help="local HF model directory (default: the bundled SmolLM2-135M-Instruct)")
    for name, kind in _SAMPLING_FLAGS.items():
        run.add_argument(_flag(name), type=kind, help=f"sampling: {name}")
    run.add_argument("--stop", action="append", help="sampling: a stop string (repeatable)")
    run.add_argument("--ignore-eos", action="store_true", default=None, help="sampling: do not stop at EOS")
    for name, kind in _ENGINE_FLAGS.items():
        run.add_argument(_flag(name), type=kind, help=f"engine: {name}")
    run.add_argument("--rows-per-shard", type=int, help="rows per output shard, the unit of resumption")
    run.add_argument("--max-in-flight", type=int, help="prompts kept in the engine at once (in each engine with "
                                                        "--data-parallel)")
    run.add_argument("--data-parallel", type=int, default=1, metavar="N",
                     help="N engine processes, one per GPU (or per share of the CPU cores), fed from one queue")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from batchllm.api import run_job
    from batchllm.connectors.jobs.job import JobInterrupted
    from batchllm.connectors.replicas.errors import ReplicaPoolError

    options: dict[str, Any] = {name: getattr(args, name) for name in (*_SAMPLING_FLAGS, "stop", "ignore_eos")
                               if getattr(args, name) is not None}
    engine = {name: getattr(args, name) for name in _ENGINE_FLAGS if getattr(args, name) is not None}
    prompt = {"prompt_column": args.prompt_column, "messages_column": args.messages_column,
              "prompt_template": args.template, "chat": args.chat, "output_column": args.output_column}
    if not args.input.endswith(".jsonl"):
        options.update(prompt)
    elif any(value for key, value in prompt.items() if key != "output_column"):
        return _fail("--prompt-column / --messages-column / --template / --chat do not apply to an OpenAI batch "
                     "file: each request carries its prompt")
    for name in ("rows_per_shard", "max_in_flight"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    try:
        result = run_job(args.input, args.output, model=args.model, engine_kwargs=engine or None,
                         use_tqdm=not args.no_progress, data_parallel_size=args.data_parallel, **options)
    except JobInterrupted as exc:
        print(f"batchllm: {exc}:\n  batchllm {shlex.join(argv)}", file=sys.stderr)
        return 128 + exc.signal_number
    except ReplicaPoolError as exc:
        print(f"batchllm: error: {exc}:\n  batchllm {shlex.join(argv)}", file=sys.stderr)
        return 1
    except _USAGE_ERRORS as exc:
        return _fail(str(exc))
    print(f"batchllm: done: {result.written_rows} rows written ({result.error_rows} with errors), "
          f"{result.resumed_rows} already done, {result.output_tokens} output tokens in {result.seconds:.1f} s "
          f"→ {result.output}", file=sys.stderr)
    for failure in result.replica_failures:
        print(f"batchllm: warning: {failure.describe()}", file=sys.stderr)
    return 0


def _fail(message: str) -> int:
    print(f"batchllm: error: {message}", file=sys.stderr)
    return 2


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
