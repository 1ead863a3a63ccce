"""The messages between the replica pool (parent) and its replica processes; all small and picklable.

Parent → replica, on the replica's task pipe: `Chunk` (rows to generate), `CheckConstraint` (compile a
structured-output constraint now), `Stop` (finish and exit). Replica → parent, on its result pipe: `Ready`
or `BuildFailed` once, then `WantWork` (at most one unanswered at a time), `Results` as rows finish,
`ConstraintChecked` for each `CheckConstraint`, and `Crashed` just before an unexpected exit.

Rows travel by sequence number (`seq`, unique within a pool): keys, texts and everything else a caller
attached to a row stay in the parent, which is what lets it re-run a dead replica's rows elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchllm.lora.request import LoRARequest
from batchllm.outputs import RequestOutput
from batchllm.sampling_params import SamplingParams
from batchllm.structured_outputs import StructuredOutputsParams


@dataclass(slots=True)
class WorkItem:
    seq: int
    token_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None
    # A row with images: its MultiModalPrompt (numpy arrays, pickled across), or the error its images gave.
    mm: Any = None
    error: str | None = None


@dataclass(slots=True)
class Chunk:
    items: list[WorkItem]


@dataclass(slots=True)
class CheckConstraint:
    token: int  # echoed in the answer
    params: StructuredOutputsParams


@dataclass(slots=True)
class ConstraintChecked:
    replica: int
    token: int
    error: BaseException | None  # the engine's exception (GrammarError) when it pickles
    message: str | None  # its text; None: the constraint compiled


@dataclass(slots=True)
class Stop:
    """Exit once nothing is in flight; the parent sends it only when it expects no more results."""


@dataclass(slots=True)
class Ready:
    replica: int
    pid: int
    max_model_len: int
    max_num_seqs: int  # the engine's, which a GPU engine may choose itself (executor/calibration.py)


@dataclass(slots=True)
class BuildFailed:
    replica: int
    error: BaseException | None  # the engine's own exception when it pickles, so callers see the same type
    traceback: str


@dataclass(slots=True)
class WantWork:
    replica: int


@dataclass(slots=True)
class Results:
    # (seq, output) with `output.prompt_token_ids` emptied: the parent has them and puts them back.
    rows: list[tuple[int, RequestOutput]]


@dataclass(slots=True)
class Crashed:
    replica: int
    traceback: str
