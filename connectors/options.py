"""The options every connector shares, validated once per call, before any generation.

Whatever is wrong for the whole call (no or several prompt sources, an unknown column, a bad sampling
value, an output column that would overwrite an input column) raises here, naming the problem. What is
wrong for a single row is the business of `prompts.py` and never raises.
"""

from __future__ import annotations

import dataclasses
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams

TRUNCATE_MODES = ("error", "left", "right")
DEFAULT_OUTPUT_COLUMN = "generated_text"
DEFAULT_EMBEDDING_COLUMN = "embedding"  # the output column of pooling tasks (embed, classify)
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init)

# A callable template gets the row as a dict and returns the prompt text or a list of chat messages.
Template = str | Callable[[dict[str, Any]], Any]


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """Where a row's prompt comes from: exactly one of the three sources.

    `chat=True` sends the text of `prompt_column` / `prompt_template` as one user message through the
    model's chat template instead of as raw completion text. `system_prompt` puts a system message first
    in every chat prompt (so it needs `chat=True` or `messages_column`); a conversation that already
    starts with a system message keeps its own. `image_column` names a column of images that go with each
    row's prompt (`batchllm/connectors/images.py` says how they are placed in it).
    """

    prompt_column: str | None = None
    messages_column: str | None = None
    template: Template | None = None
    chat: bool = False
    system_prompt: str | None = None
    image_column: str | None = None

    def __post_init__(self) -> None:
        given = [name for name, value in (("prompt_column", self.prompt_column),
                                          ("messages_column", self.messages_column),
                                          ("prompt_template", self.template)) if value is not None]
        if len(given) != 1:
            raise ValueError("pass exactly one of prompt_column=, messages_column= or prompt_template="
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.chat and self.messages_column is not None:
            raise ValueError("chat=True applies to prompt_column= or prompt_template=; messages_column= is "
                             "always rendered with the chat template")
        if self.template is not None and not (isinstance(self.template, str) or callable(self.template)):
            raise ValueError(f"prompt_template must be a format string or a callable, got "
                             f"{type(self.template).__name__}")
        if isinstance(self.template, str):
            template_fields(self.template)  # raises on malformed braces or positional fields
        if self.system_prompt is not None:
            if not isinstance(self.system_prompt, str) or not self.system_prompt.strip():
                raise ValueError(f"system_prompt must be a non-empty string, got {self.system_prompt!r}")
            if not self.chat and self.messages_column is None:
                raise ValueError("system_prompt= applies to chat prompts: pass chat=True or messages_column=")
        if self.image_column is not None and (not isinstance(self.image_column, str) or not self.image_column):
            raise ValueError(f"image_column must be a non-empty string, got {self.image_column!r}")

    def required_columns(self, available: Sequence[str]) -> list[str]:
        """The input columns a row's prompt needs; raises ValueError naming any that do not exist."""
        if self.prompt_column is not None:
            needed = [self.prompt_column]
        elif self.messages_column is not None:
            needed = [self.messages_column]
        elif isinstance(self.template, str):
            needed = template_fields(self.template)
        else:
            needed = list(available)  # a callable sees the whole row
        if self.image_column is not None and self.image_column not in needed:
            needed = [*needed, self.image_column]
        missing = [name for name in needed if name not in available]
        if missing:
            raise ValueError(f"unknown column{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}; "
                             f"the input has {list(available)}")
        return needed

    def describe(self) -> dict[str, Any]:
        """A JSON-able identity for job manifests (a callable is known by its qualified name only)."""
        template = self.template
        if callable(template):
            template = f"<callable {getattr(template, '__module__', '?')}.{getattr(template, '__qualname__', '?')}>"
        identity = {"prompt_column": self.prompt_column, "messages_column": self.messages_column,
                    "prompt_template": template, "chat": self.chat}
        if self.system_prompt is not None:  # only when set: manifests of jobs without one stay resumable
            identity["system_prompt"] = self.system_prompt
        if self.image_column is not None:
            identity["image_column"] = self.image_column
        return identity


@dataclass(frozen=True, slots=True)
class OutputNames:
    """Names of the output columns.

    With the default output column they are `generated_text`, `finish_reason`, `prompt_tokens`,
    `completion_tokens`, `error` (and `logprobs`, `parsed` with parse_json=True, and `reasoning` from an engine
    with a reasoning parser). With
    `output_column="answer"` the others get the prefix `answer_` (`answer_error`, ...), so a second
    `generate` over the same table can add its own columns without clobbering the first one's. Pooling tasks
    write `embedding`, `prompt_tokens` and `error` (prefixed the same way under another output column).
    """

    text: str
    finish_reason: str
    prompt_tokens: str
    completion_tokens: str
    error: str
    logprobs: str
    parsed: str
    reasoning: str

    @classmethod
    def for_column(cls, output_column: str, default: str = DEFAULT_OUTPUT_COLUMN) -> OutputNames:
        if not isinstance(output_column, str) or not output_column:
            raise ValueError(f"output_column must be a non-empty string, got {output_column!r}")
        prefix = "" if output_column == default else f"{output_column}_"
        return cls(output_column, *(prefix + name for name in
                                    ("finish_reason", "prompt_tokens", "completion_tokens", "error", "logprobs",
                                     "parsed", "reasoning")))


@dataclass(frozen=True, slots=True)
class MapOptions:
    """Everything that decides a row's output, besides the model.

    Structured outputs: a call-wide constraint is `sampling_params.structured_outputs`; `schema_column`
    names a column holding a JSON schema per row instead (the two exclude each other). `parse_json` adds
    the `parsed` output column and needs a JSON constraint (json / json_object, or a schema column).
    """

    prompt: PromptSpec
    sampling_params: SamplingParams
    names: OutputNames
    truncate: str = "error"
    schema_column: str | None = None
    parse_json: bool = False
    lora_column: str | None = None
    loras: tuple[tuple[str, str], ...] = ()  # (name, adapter directory), sorted by name
    task: str = "generate"  # or a pooling task ("embed", "classify", "score"): a vector per row, nothing generated
    pooling: PoolingParams | None = None  # a pooling task's, set from the engine (`with_engine`)
    embedding_dim: int = 0  # the pooled vector's length, from the engine
    reasoning: str | None = None  # the engine's reasoning parser: a `reasoning` column (`with_engine`)

    def __post_init__(self) -> None:
        if self.lora_column is not None and (not isinstance(self.lora_column, str) or not self.lora_column):
            raise ValueError(f"lora_column must be a non-empty string, got {self.lora_column!r}")
        if (self.lora_column is None) != (not self.loras):
            raise ValueError("lora_column= (each row's adapter name) and loras= ({name: adapter directory}) go "
                             "together: pass both or neither")
        if self.schema_column is not None:
            if not isinstance(self.schema_column, str) or not self.schema_column:
                raise ValueError(f"schema_column must be a non-empty string, got {self.schema_column!r}")
            if self.sampling_params.structured_outputs is not None:
                raise ValueError(f"schema_column={self.schema_column!r} (a JSON schema per row) and a call-wide "
                                 f"structured_outputs= ({self.sampling_params.structured_outputs.kind}) exclude "
                                 f"each other: pass one of them")
        if not isinstance(self.parse_json, bool):
            raise ValueError(f"parse_json must be True or False, got {self.parse_json!r}")
        constraint = self.sampling_params.structured_outputs
        if self.parse_json and self.schema_column is None and (constraint is None or
                                                               constraint.kind not in ("json", "json_object")):
            got = "no constraint" if constraint is None else f"a {constraint.kind} constraint"
            raise ValueError(f"parse_json=True needs a JSON constraint: structured_outputs="
                             f"StructuredOutputsParams(json=... or json_object=True) or schema_column=; got {got}")

    @property
    def with_logprobs(self) -> bool:
        return self.sampling_params.logprobs is not None

    @property
    def pools(self) -> bool:
        return self.task != "generate"

    def with_engine(self, engine: Any) -> MapOptions:
        """The options with the engine's pooling (a pooling task) filled in; the engine must be of the task."""
        if getattr(engine, "task", "generate") != self.task:
            raise ValueError(f"the engine was built with task={getattr(engine, 'task', 'generate')!r}, this call needs "
                             f"task={self.task!r}")
        if not self.pools:
            if getattr(engine, "reasoning_parser", None) is None:
                return self
            return dataclasses.replace(self, reasoning=engine.reasoning_parser.name)
        return dataclasses.replace(self, pooling=engine.pooling_params, embedding_dim=engine.embedding_dim)

    def output_names(self) -> list[str]:
        names = self.names
        if self.pools:
            return [names.text, names.prompt_tokens, names.error]
        columns = [names.text, names.finish_reason, names.prompt_tokens, names.completion_tokens, names.error]
        if self.with_logprobs:
            columns.append(names.logprobs)
        if self.parse_json:
            columns.append(names.parsed)
        if self.reasoning:
            columns.append(names.reasoning)
        return columns

    def check_input_columns(self, available: Sequence[str]) -> list[str]:
        """Fail fast on unknown prompt columns or output columns that already exist; returns the needed ones."""
        needed = self.prompt.required_columns(available)
        for option, column in (("schema_column", self.schema_column), ("lora_column", self.lora_column)):
            if column is not None and column not in needed:
                if column not in available:
                    raise ValueError(f"unknown column {column!r} ({option}=); the input has {list(available)}")
                needed = [*needed, column]
        clashes = [name for name in self.output_names() if name in available]
        if clashes:
            raise ValueError(f"the input already has column{'s' if len(clashes) > 1 else ''} "
                             f"{', '.join(map(repr, clashes))}; pass another output_column= (the other output "
                             f"columns take it as a prefix) or drop them first")
        return needed

    def describe(self) -> dict[str, Any]:
        if self.pools:  # nothing is sampled: the pooling decides the output
            return {"prompt": self.prompt.describe(), "task": self.task, "output_column": self.names.text,
                    "truncate": self.truncate, "pooling": dataclasses.asdict(self.pooling) if self.pooling else None}
        identity = {"prompt": self.prompt.describe(), "sampling_params": params_dict(self.sampling_params),
                    "output_column": self.names.text, "truncate": self.truncate}
        # Only when set: manifests of jobs without them stay resumable.
        if self.schema_column is not None:
            identity["schema_column"] = self.schema_column
        if self.parse_json:
            identity["parse_json"] = True
        if self.lora_column is not None:
            identity["lora_column"], identity["loras"] = self.lora_column, [list(pair) for pair in self.loras]
        if self.reasoning is not None:
            identity["reasoning_parser"] = self.reasoning
        return identity


def resolve_options(*, prompt_column: str | None = None, messages_column: str | None = None,
                    prompt_template: Template | None = None, chat: bool = False, system_prompt: str | None = None,
                    sampling_params: SamplingParams | None = None, output_column: str = DEFAULT_OUTPUT_COLUMN,
                    truncate: str = "error", schema_column: str | None = None, parse_json: bool = False,
                    lora_column: str | None = None, loras: Mapping[str, str | Path] | None = None,
                    sampling_fields: Mapping[str, Any] | None = None, task: str = "generate",
                    image_column: str | None = None) -> MapOptions:
    """Validate the per-call options; `sampling_fields` are the caller's other keywords: SamplingParams fields,
    and `system_prompt` when the caller does not name it itself (the Parquet job and batchllm.ray pass their
    remaining keywords on as they come). A call-wide `structured_outputs` is a sampling field like any other."""
    if truncate not in TRUNCATE_MODES:
        raise ValueError(f"truncate must be one of {TRUNCATE_MODES}, got {truncate!r}")
    fields = dict(sampling_fields or {})
    system_prompt = fields.pop("system_prompt", system_prompt)
    pools = task != "generate"
    if pools:
        used = [name for name, value in (("sampling_params", sampling_params), ("schema_column", schema_column),
                                         ("parse_json", parse_json or None), *fields.items()) if value is not None]
        if used:
            raise ValueError(f"task={task!r} samples nothing: {', '.join(used)} {'do' if len(used) > 1 else 'does'} "
                             f"not apply")
        if output_column == DEFAULT_OUTPUT_COLUMN:
            output_column = DEFAULT_EMBEDDING_COLUMN
    names = OutputNames.for_column(output_column, DEFAULT_EMBEDDING_COLUMN if pools else DEFAULT_OUTPUT_COLUMN)
    return MapOptions(PromptSpec(prompt_column, messages_column, prompt_template, chat, system_prompt, image_column),
                      resolve_sampling_params(sampling_params, fields), names, truncate, schema_column, parse_json,
                      lora_column, lora_pairs(loras), task)


def lora_pairs(loras: Mapping[str, str | Path] | None) -> tuple[tuple[str, str], ...]:
    """`loras={name: adapter directory}` as sorted pairs (hashable, and in the order adapter ids follow)."""
    if loras is None:
        return ()
    if not isinstance(loras, Mapping) or not all(isinstance(name, str) and name for name in loras):
        raise ValueError(f"loras must map adapter names to PEFT adapter directories, got {loras!r}")
    return tuple(sorted((name, str(path)) for name, path in loras.items()))


def resolve_sampling_params(sampling_params: SamplingParams | None, fields: Mapping[str, Any]) -> SamplingParams:
    unknown = sorted(set(fields) - _SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                        f"(sampling fields are {sorted(_SAMPLING_FIELDS)})")
    if sampling_params is not None:
        if fields:
            raise ValueError(f"pass sampling_params= or sampling fields as keywords ({', '.join(fields)}), not both")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        return sampling_params
    return SamplingParams(**fields)


def with_system_prompt(conversation: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """`conversation` with `system_prompt` first, unless there is none or it starts with its own system message."""
    if system_prompt is None or conversation[0]["role"] == "system":
        return conversation
    return [{"role": "system", "content": system_prompt}, *conversation]


def template_fields(template: str) -> list[str]:
    """The columns a format-string template names: `{q}`, `{meta[lang]}` and `{obj.attr}` all name a column."""
    names: list[str] = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        column = field.split(".", 1)[0].split("[", 1)[0]
        if not column or column.isdigit():
            raise ValueError(f"prompt_template {template!r} has a positional field {{{field}}}; name a column")
        if column not in names:
            names.append(column)
    return names


def params_dict(params: SamplingParams) -> dict[str, Any]:
    """The fields as JSON-able values (job fingerprints); `structured_outputs` only when set, as its
    `describe()`, so the manifests of jobs without a constraint stay resumable."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    constraint = fields.pop("structured_outputs")
    if constraint is not None:
        fields["structured_outputs"] = constraint.describe()
    return fields
