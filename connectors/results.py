"""Per-row results and the typed Arrow output columns built from them.

Column types are fixed by the options alone (never inferred from the values), so an empty input, an
all-error batch and every shard of a job share one schema:

- text and `finish_reason`: string, or list<string> with one entry per sample when n > 1;
- `prompt_tokens`: int32; `completion_tokens`: int32, or list<int32> when n > 1;
- `error`: string, null when the row succeeded;
- `logprobs` (only when logprobs are asked for): per generated token a struct of the token, its id, its
  logprob and the top alternatives; a list of those per sample when n > 1;
- `parsed` (only with parse_json=True): the JSON value of a JSON-constrained completion as canonical JSON
  text (`constraints.parsed_json_text`), list<string> when n > 1; null where the row failed, is not
  JSON-constrained, finished with "length" or does not parse. A string, not a struct: rows with different
  schemas (a schema column) have no common struct type, and even one schema's `oneOf`, `additionalProperties`
  or recursion have none. The pandas and list-of-dicts connectors turn it into Python objects.
- `reasoning` (only from an engine with a reasoning parser): the completion's thinking, string (list<string> when
  n > 1); null where the row failed or its output has no reasoning section. The text column then holds the answer.

A failed row has null text, `finish_reason="error"` (`["error"] * n` when n > 1, so the column keeps one
entry per sample), null `completion_tokens` and its `prompt_tokens` when the prompt could be tokenized.
Pooling tasks (embed, classify): the vector column is fixed_size_list<float32, dim> (dim: the model's hidden size,
or a classifier's labels), built from one float32 buffer without a Python object per row; null where the row
failed; then `prompt_tokens` and `error`.

A row that generated but carries a note from the engine (a structured-output row stopped, by max_tokens or a
stop string, before its constraint was complete) keeps its text, token count and finish_reason
("length" / "stop"), with the note in `error`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from batchllm.connectors.constraints import is_json_constraint, parsed_json_text
from batchllm.connectors.options import MapOptions
from batchllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput
from batchllm.pooling_params import PoolingParams
from batchllm.sampling_params import SamplingParams

_ALTERNATIVE = pa.struct([("token", pa.string()), ("token_id", pa.int32()), ("logprob", pa.float64())])
_TOKEN_LOGPROB = pa.struct([("token", pa.string()), ("token_id", pa.int32()), ("logprob", pa.float64()),
                            ("top_logprobs", pa.list_(_ALTERNATIVE))])


@dataclass(slots=True)
class RowOutcome:
    """One row's result: the engine's output, or the error that kept the row from the engine."""

    output: RequestOutput | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    # The request's top-k for logprobs: each step's logprob dict holds k or k + 1 tokens, so k must travel along.
    top_logprobs: int | None = None
    json_constrained: bool = False  # the row ran under a JSON constraint: its `parsed` value is its text's

    @classmethod
    def from_output(cls, output: RequestOutput | PoolingRequestOutput, params: SamplingParams | PoolingParams
                    ) -> RowOutcome:
        if isinstance(output, PoolingRequestOutput):
            return cls(output, output.error, len(output.prompt_token_ids))
        return cls(output, output.error, len(output.prompt_token_ids), params.logprobs,
                   is_json_constraint(params.structured_outputs))

    @property
    def failed(self) -> bool:
        """No completion to show: the row never ran, or the engine failed it (a sample finished with "error").
        An `error` on completions that finished otherwise is a note about them (see the module docstring)."""
        if self.output is None or not self.output.outputs:
            return True
        return self.error is not None and any(c.finish_reason == "error" for c in self.output.outputs)

    @property
    def completion_tokens(self) -> int:
        if self.output is None or isinstance(self.output, PoolingRequestOutput):
            return 0
        return sum(len(c.token_ids) for c in self.output.outputs)


def output_schema(options: MapOptions) -> pa.Schema:
    if options.pools:
        return pa.schema([(options.names.text, pa.list_(pa.float32(), options.embedding_dim)),
                          (options.names.prompt_tokens, pa.int32()), (options.names.error, pa.string())])
    many = options.sampling_params.n > 1
    text = pa.list_(pa.string()) if many else pa.string()
    fields = [(options.names.text, text), (options.names.finish_reason, text),
              (options.names.prompt_tokens, pa.int32()),
              (options.names.completion_tokens, pa.list_(pa.int32()) if many else pa.int32()),
              (options.names.error, pa.string())]
    if options.with_logprobs:
        per_sample = pa.list_(_TOKEN_LOGPROB)
        fields.append((options.names.logprobs, pa.list_(per_sample) if many else per_sample))
    if options.parse_json:
        fields.append((options.names.parsed, text))
    if options.reasoning:
        fields.append((options.names.reasoning, text))
    return pa.schema(fields)


def output_arrays(outcomes: list[RowOutcome], options: MapOptions) -> list[pa.Array]:
    """The output columns for `outcomes`, in `output_schema(options)` order."""
    if options.pools:
        return _pooled_arrays(outcomes, options)
    n = options.sampling_params.n
    many = n > 1
    failed_reason = ["error"] * n if many else "error"
    columns: list[list[Any]] = [[] for _ in output_schema(options)]
    for outcome in outcomes:
        completions = None if outcome.failed else outcome.output.outputs
        values = [
            _per_sample(completions, many, lambda c: c.text),
            failed_reason if completions is None else _per_sample(completions, many, lambda c: c.finish_reason),
            outcome.prompt_tokens,
            _per_sample(completions, many, lambda c: len(c.token_ids)),
            outcome.error,
        ]
        if options.with_logprobs:
            values.append(_per_sample(completions, many, lambda c: token_logprobs(c, outcome.top_logprobs or 0)))
        if options.parse_json:
            values.append(_per_sample(completions if outcome.json_constrained else None, many,
                                      lambda c: parsed_json_text(c.text, c.finish_reason, c.error)))
        if options.reasoning:
            values.append(_per_sample(completions, many, lambda c: c.reasoning))
        for column, value in zip(columns, values):
            column.append(value)
    return [pa.array(values, type=field.type) for values, field in zip(columns, output_schema(options))]


def _pooled_arrays(outcomes: list[RowOutcome], options: MapOptions) -> list[pa.Array]:
    dim = options.embedding_dim
    vectors = np.zeros((len(outcomes), dim), dtype=np.float32)
    valid = np.zeros(len(outcomes), dtype=bool)
    for row, outcome in enumerate(outcomes):
        if outcome.output is not None and outcome.output.outputs is not None:
            vectors[row] = outcome.output.outputs.data
            valid[row] = True
    column = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim, mask=pa.array(~valid))
    schema = output_schema(options)
    return [column, pa.array([o.prompt_tokens for o in outcomes], type=schema.field(1).type),
            pa.array([o.error for o in outcomes], type=pa.string())]


def _per_sample(completions: list[CompletionOutput] | None, many: bool, get) -> Any:
    if completions is None:
        return None
    return [get(c) for c in completions] if many else get(completions[0])


def token_logprobs(completion: CompletionOutput, top_k: int) -> list[dict[str, Any]] | None:
    """OpenAI's shape: the sampled token's logprob and the `top_k` most likely tokens at each step.

    Each step's dict holds the top-k tokens and the sampled one (which may rank below k), keyed by id.
    """
    if completion.logprobs is None:
        return None
    entries = []
    for token_id, step in zip(completion.token_ids, completion.logprobs):
        ranked = sorted(step.items(), key=lambda item: item[1].rank if item[1].rank is not None else len(step))
        entries.append({
            "token": step[token_id].decoded_token, "token_id": token_id, "logprob": step[token_id].logprob,
            "top_logprobs": [{"token": lp.decoded_token, "token_id": tid, "logprob": lp.logprob}
                             for tid, lp in ranked[:top_k]],
        })
    return entries
