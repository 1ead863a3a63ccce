"""The `batchllm` command (also `python -m batchllm`).

    batchllm run INPUT OUTPUT --prompt-column question --max-tokens 128
    batchllm --version

`batchllm run --help` shows every flag with its default. The CLI's sampling defaults suit batch jobs, unlike
vLLM's SamplingParams defaults that the Python API keeps (temperature 1.0, 16 tokens): greedy decoding
(`--temperature 0`, reproducible: a shard redone after a kill equals the first attempt) and up to
`--max-tokens 256`. For an OpenAI batch file they are the defaults for fields a request does not set.
Errors name the flags (`--rows-per-shard`), not the Python arguments behind them.

Structured outputs: `--json-schema FILE`, `--regex PATTERN` or `--choice A,B,C` (or a JSON array) constrain every
row (for an OpenAI batch file: every request without a response_format of its own); `--schema-column NAME` takes each
row's JSON schema from a column instead; `--parse-json` adds the `parsed` column. A constraint the grammar
engine cannot compile exits with status 2 before anything is generated.

Adapters: `--lora NAME=PATH` (repeatable) registers PEFT LoRA adapters; a table's `--lora-column` names each row's
(empty: the base model), an OpenAI batch request's `model` names its own. An adapter the engine cannot apply
exits with status 2 before anything is generated; a row naming an unknown one gets an error.

Exit status: 0 done; 2 bad arguments or options, e.g. a model directory without a tokenizer (nothing
generated); 128 + N after signal N (SIGINT: 130, SIGTERM: 143) with every finished row saved: run the
same command again to resume; 1 when every data-parallel replica died (completed shards saved, resumable
too). Also 2, with the path named and no traceback: the output is in use by another job, or the file
system refused (read-only, full, permissions); what was saved stays saved.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from batchllm.connectors.jobs.job import DEFAULT_FLUSH_SECONDS, DEFAULT_MAX_TOKENS_CAP, DEFAULT_ROWS_PER_SHARD
from batchllm.connectors.jobs.sources import INPUT_FORMATS, input_format_of
from batchllm.entrypoints.cli.engine_flags import (
    USAGE_ERRORS,
    OneLineErrors,
    add_engine_flags,
    engine_options,
    fail,
    flag,
    flags_by_python_name,
    with_flag_names,
)
from batchllm.entrypoints.cli.models import job_models
from batchllm.entrypoints.cli.types import adapter, constraint_of, json_schema_file, served_model, token_ids
from batchllm.entrypoints.server.cli import add_serve_parser
from batchllm.sampling_params import SamplingParams

# Sampling flags → SamplingParams fields. Each defaults to SamplingParams' own, except _CLI_SAMPLING_DEFAULTS.
_SAMPLING_FLAGS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
                   "seed": int, "n": int, "min_tokens": int, "presence_penalty": float,
                   "frequency_penalty": float, "repetition_penalty": float, "logprobs": int}
# Batch jobs want complete, reproducible answers; see the module docstring.
_CLI_SAMPLING_DEFAULTS = {"max_tokens": 256, "temperature": 0.0}
_SAMPLING_DEFAULTS = {**{f.name: f.default for f in dataclasses.fields(SamplingParams) if f.init},
                      **_CLI_SAMPLING_DEFAULTS}
_SAMPLING_HELP = {"max_tokens": "most tokens per completion", "temperature": "temperature (0: greedy)",
                  "n": "completions per row (list columns when > 1; with --temperature 0 they are equal)",
                  "seed": "seed (None: unseeded)", "top_k": "top_k (0: off)",
                  "logprobs": "top logprobs returned per generated token (None: none)"}
# Python argument names that differ from their flag's (the rest are the flag's dest).
_PYTHON_NAMES = {"prompt_template": "template", "data_parallel_size": "data_parallel", "models": "model"}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    return args.handler(args, argv)


def _version() -> str:
    """The installed distribution's version; a source tree on PYTHONPATH (not installed) has only the package's."""
    try:
        return importlib.metadata.version("batchllm")
    except importlib.metadata.PackageNotFoundError:
        import batchllm

        return batchllm.__version__


def _parser() -> argparse.ArgumentParser:
    parser = OneLineErrors(prog="batchllm", description="Offline LLM batch inference.")  # its subcommands' too
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run", help="generate for every row of a table (Parquet, CSV, JSON lines) or an OpenAI batch JSONL file "
                    "(resumable)",
        description="Parquet file / directory / glob, *.csv or JSON-lines table → a directory of Parquet "
                    "shards; OpenAI batch *.jsonl → a response *.jsonl. Re-running the same command resumes an "
                    "interrupted job.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run.add_argument("input", help="Parquet file, directory or glob, CSV file or JSON-lines table; or an OpenAI "
                                   "batch request file (*.jsonl)")
    run.add_argument("output", help="output directory (table input) or output .jsonl file (OpenAI batch input)")
    run.add_argument("--input-format", choices=INPUT_FORMATS,
                     default="auto", help="how to read INPUT; auto: by extension, and a *.jsonl / *.json file is an "
                                          "OpenAI batch file when its first line is a request, else a table")
    prompt = run.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-column", "--text-column", dest="prompt_column",
                        help="column holding the prompt text (with --task embed: the text to embed)")
    prompt.add_argument("--messages-column", help="column holding chat messages (a list of {role, content})")
    prompt.add_argument("--template", help="str.format template over the row's columns, e.g. 'Q: {question}'")
    prompt.add_argument("--prompt", metavar="TEXT",
                        help="the same prompt for every row, e.g. 'Describe the image.' with --image-column (braces "
                             "are literal)")
    run.add_argument("--image-column", metavar="NAME",
                     help="column holding each row's image or list of images (binary, a {bytes, path} struct, a path "
                          "or a data: URL) for a vision-language model; a prompt without the image placeholder gets "
                          "the images first, through the chat template; tables only")
    run.add_argument("--chat", action="store_true", help="send the prompt text as a user message through the "
                                                         "model's chat template")
    run.add_argument("--system-prompt", metavar="TEXT",
                     help="a system message put first in every chat prompt (--chat or --messages-column; rows whose "
                          "messages start with their own keep it); not for OpenAI batch files, whose requests carry "
                          "their own messages")
    run.add_argument("--output-column", default="generated_text",
                     help="name of the generated-text column (with --task embed: of the vector column, default "
                          "embedding)")
    constraint = run.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", type=json_schema_file, metavar="FILE",
                            help="structured outputs: every completion is JSON valid against the JSON schema in FILE "
                                 "(an OpenAI batch file: the requests without their own response_format)")
    constraint.add_argument("--regex", metavar="PATTERN", type=constraint_of("regex"),
                            help="structured outputs: every completion matches the regular expression (whole output)")
    constraint.add_argument("--choice", metavar="A,B,...", type=constraint_of("choice"),
                            help="structured outputs: every completion is one of the comma-separated strings (or of "
                                 "a JSON array of strings, for choices with commas)")
    constraint.add_argument("--schema-column", metavar="NAME",
                            help="structured outputs: column holding each row's JSON schema (JSON text; null: "
                                 "unconstrained); tables only")
    run.add_argument("--parse-json", action="store_true",
                     help="add a `parsed` column: the canonical JSON text of each completion constrained by "
                          "--json-schema or --schema-column (--regex and --choice outputs are not JSON); named after "
                          "--output-column like the other columns (answer_parsed), a list per row with --n > 1; "
                          "tables only")
    run.add_argument("--lora", type=adapter, action="append", metavar="NAME=PATH",
                     help="a PEFT LoRA adapter directory under a name (repeatable): rows name theirs in --lora-column; "
                          "an OpenAI batch request's `model` names its adapter")
    run.add_argument("--lora-column", metavar="NAME", help="column holding each row's adapter name (empty or null: "
                                                           "the base model); tables only")
    run.add_argument("--truncate", choices=("error", "left", "right"),
                     help="what to do with a prompt that leaves no room for --max-tokens: error the row, or cut its "
                          "left or right end (None: error; with --task embed, where a prompt may fill the model's "
                          "length, right)")
    run.add_argument("--model", type=served_model, action="append", metavar="[NAME=]PATH",
                     help="local HF model directory (None: the bundled SmolLM2-135M-Instruct); repeatable as NAME=PATH "
                          "for several models, each row on its own: a table's --model-column names each row's, an "
                          "OpenAI batch request's `model` its own (none: the first); one engine per model, sharing "
                          "the GPU's memory; not with --data-parallel, --lora, --dry-run or a pooling --task")
    run.add_argument("--model-column", metavar="NAME",
                     help="column holding each row's model name, among the --model NAME=PATH given (a bare PATH is "
                          "named after its directory); a null or another name fails that row; the output gets a "
                          "`model` column; tables only")
    for name, kind in _SAMPLING_FLAGS.items():
        run.add_argument(flag(name), type=kind, default=_SAMPLING_DEFAULTS[name],
                         help=f"sampling: {_SAMPLING_HELP.get(name, name)}")
    run.add_argument("--stop", action="append", help="sampling: a stop string (repeatable)")
    run.add_argument("--stop-token-ids", type=token_ids, metavar="ID,ID,...",
                     help="sampling: token ids that end a completion, comma-separated")
    run.add_argument("--ignore-eos", action="store_true", help="sampling: do not stop at EOS")
    run.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction,
                     default=_SAMPLING_DEFAULTS["skip_special_tokens"],
                     help="sampling: leave special tokens out of the text")
    add_engine_flags(run)
    run.add_argument("--rows-per-shard", type=int, default=DEFAULT_ROWS_PER_SHARD,
                     help="rows per output shard, the unit of resumption")
    run.add_argument("--max-in-flight", type=int, help="prompts kept in the engine at once (in each engine with "
                                                        "--data-parallel; None: twice --max-num-seqs)")
    run.add_argument("--max-tokens-cap", type=int, default=DEFAULT_MAX_TOKENS_CAP,
                     help="most output tokens of any row, whatever it asks: an OpenAI batch request's larger (or "
                          "null) max_tokens gets this")
    run.add_argument("--flush-seconds", type=float, default=DEFAULT_FLUSH_SECONDS,
                     help="how often the finished rows of unfinished shards are saved: a kill loses at most that much")
    run.add_argument("--retry-errors", action="store_true",
                     help="re-run the rows saved with an error, in place: every row stays in the output once")
    run.add_argument("--data-parallel", type=int, default=1, metavar="N",
                     help="N engine processes, one per GPU (or per share of the CPU cores), fed from one queue")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--dry-run", action="store_true",
                     help="check the input, the flags and every row's prompt, print the row count, the prompt tokens, "
                          "a few prompts and an estimate of the run time; load no weights, write nothing (exit 1 if "
                          "rows would fail)")
    # Last, so it sees every flag: how run_job's argument names read as flags in error messages.
    run.set_defaults(flags_by_python_name=flags_by_python_name(run, _PYTHON_NAMES), handler=_run)
    add_serve_parser(commands)
    return parser


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    from batchllm.connectors.jobs.job import JobInterrupted
    from batchllm.connectors.jobs.manifest import ManifestMismatch
    from batchllm.connectors.replicas.errors import ReplicaPoolError
    from batchllm.entrypoints.api import run_job
    from batchllm.entrypoints.cli.resume import changed_options_message

    sampling = (*_SAMPLING_FLAGS, "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens")
    job = ("rows_per_shard", "max_in_flight", "max_tokens_cap", "flush_seconds", "retry_errors")
    options: dict[str, Any] = {name: getattr(args, name) for name in (*sampling, *job)
                               if getattr(args, name) is not None}
    engine = engine_options(args)
    if engine.get("task", "generate") != "generate":  # nothing is sampled: only sampling flags actually given count
        options = {name: value for name, value in options.items()
                   if name not in sampling or value != _SAMPLING_DEFAULTS[name]}
    if args.truncate is not None:
        options["truncate"] = args.truncate
    # --prompt is a template without fields: its braces are escaped, so they stay text.
    fixed = None if args.prompt is None else args.prompt.replace("{", "{{").replace("}", "}}")
    prompt = {"prompt_column": args.prompt_column, "messages_column": args.messages_column,
              "prompt_template": args.template if fixed is None else fixed, "chat": args.chat,
              "system_prompt": args.system_prompt, "image_column": args.image_column,
              "output_column": args.output_column}
    if args.lora:
        engine["enable_lora"] = True
        options["loras"] = dict(args.lora)
        if len(options["loras"]) < len(args.lora):
            return fail("--lora names an adapter twice")
    elif args.lora_column is not None:
        return fail("--lora-column needs the adapters it names: --lora NAME=PATH (repeatable)")
    constraint = args.json_schema or args.regex or args.choice
    if constraint is not None:
        options["structured_outputs"] = constraint
    if args.parse_json and args.schema_column is None and args.json_schema is None:
        return fail("--parse-json needs a JSON constraint: --json-schema FILE or --schema-column NAME")
    input_format = input_format_of(args.input, args.input_format)
    try:
        model = job_models(args.model, args.model_column, input_format, options)
    except ValueError as exc:
        return fail(str(exc))
    if input_format != "openai-batch":
        options.update(prompt)
        options.update(schema_column=args.schema_column, parse_json=args.parse_json)
        if args.lora:
            if args.lora_column is None:
                return fail("--lora on a table needs --lora-column: the column naming each row's adapter")
            options["lora_column"] = args.lora_column
    elif any(value for key, value in prompt.items() if key != "output_column"):
        return fail("--prompt-column / --messages-column / --template / --prompt / --chat / --system-prompt / "
                    "--image-column do not apply to an OpenAI batch file: each request carries its prompt (and its "
                    "images, as image_url parts)")
    elif args.lora_column is not None:
        return fail("--lora-column does not apply to an OpenAI batch file: a request's `model` names its adapter")
    elif args.schema_column is not None or args.parse_json:
        return fail("--schema-column / --parse-json do not apply to an OpenAI batch file: a request's "
                    "response_format carries its schema (--json-schema / --regex / --choice set the default)")
    try:
        if args.dry_run and "models" in options:
            return fail("--dry-run plans the rows of one model: give one --model")
        if args.dry_run and args.image_column is not None:
            return fail("--dry-run does not plan rows with images (--image-column) yet: it loads no image processor")
        if args.dry_run:  # the same arguments, checked and sized (batchllm/connectors/jobs/dry_run.py)
            from batchllm.connectors.jobs.dry_run import print_dry_run

            return print_dry_run(args.input, args.output, input_format=input_format, model=model,
                                 engine_kwargs=engine or None, data_parallel_size=args.data_parallel, **options)
        result = run_job(args.input, args.output, input_format=input_format, model=model,
                         engine_kwargs=engine or None, use_tqdm=not args.no_progress,
                         data_parallel_size=args.data_parallel, **options)
    except JobInterrupted as exc:
        print(f"batchllm: {exc}:\n  batchllm {shlex.join(argv)}", file=sys.stderr)
        return 128 + exc.signal_number
    except ReplicaPoolError as exc:
        print(f"batchllm: error: {exc}:\n  batchllm {shlex.join(argv)}", file=sys.stderr)
        return 1
    except ManifestMismatch as exc:  # what changed since the job started, by flag
        return fail(changed_options_message(exc, args.flags_by_python_name))
    except USAGE_ERRORS as exc:
        return fail(with_flag_names(str(exc), args.flags_by_python_name))
    except OSError as exc:  # what the file system said (EROFS, ENOSPC, EACCES, ...), and where
        return fail(_os_error_message(exc))
    if result.complete and result.written_rows == 0:  # an earlier run saved every row: say so, not "0 rows written"
        print(f"batchllm: nothing to do: the job is complete ({result.total_rows} rows in {result.output})",
              file=sys.stderr)
        return 0
    preempted = (f", {result.preemptions} preemptions ({result.recomputed_tokens} prompt tokens recomputed)"
                 if result.preemptions else "")
    print(f"batchllm: done: {result.written_rows} rows written ({result.error_rows} with errors), "
          f"{result.resumed_rows} already done, {result.output_tokens} output tokens in {result.seconds:.1f} s"
          f"{preempted} → {result.output}", file=sys.stderr)
    for failure in result.replica_failures:
        print(f"batchllm: warning: {failure.describe()}", file=sys.stderr)
    return 0


def _os_error_message(exc: OSError) -> str:
    if exc.filename is None:
        return str(exc)  # ours, e.g. OutputInUse: the message names the path
    paths = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    return f"{exc.strerror or type(exc).__name__}: {paths}"
