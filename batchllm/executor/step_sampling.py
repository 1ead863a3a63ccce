"""Sampling a step's logits rows: their sampling tensors (built while the forward pass runs), the sampler or the
rejection sampler, the device proposer's drafts after them, and the `StepOutput` that carries the sampled ids to
the host. Mixed into `ModelRunner` (model_runner.py), whose state it reads and updates.
"""

from __future__ import annotations

import torch

from batchllm.distributed.parallel_state import broadcast_from_driver
from batchllm.engine.interfaces import AwaitingGrammar, GrammarBitmask, SchedulerOutput
from batchllm.executor.drafter_base import Drafter
from batchllm.executor.input_batch import InputBatch
from batchllm.executor.sampled_rows import RequestState, SampledRows, record_tokens
from batchllm.executor.step_batch import RequestStates, StepBatch
from batchllm.executor.step_output import HostTokenBuffers, StepOutput, ignore_result
from batchllm.model.layers.rejection_sampler import DraftBatch, RejectionSampler
from batchllm.model.layers.sampler import Sampler, SamplerOutput
from batchllm.model.layers.sampling_tensors import SamplingTensors


class StepSampling:
    device: torch.device
    model: torch.nn.Module
    drafter: Drafter | None
    sampler: Sampler
    rejection_sampler: RejectionSampler
    eos_token_ids: frozenset[int]
    inputs: InputBatch
    requests: RequestStates
    _host_tokens: HostTokenBuffers
    _share_samples: bool
    # The last step's sampled ids on the device, and the row of each request in it.
    _last_sampled: torch.Tensor | None
    _last_rows: dict[str, int]
    _unread: StepOutput | None  # the newest step whose tokens the host has not read yet

    def _sample(self, so: SchedulerOutput, batch: StepBatch, hidden: torch.Tensor, logits_indices: torch.Tensor
                ) -> StepOutput | AwaitingGrammar:
        logits = self.model.compute_logits(hidden[logits_indices])
        rows = SampledRows(batch.sampled_states, batch.sample_positions, batch.drafts, batch.lookahead, hidden,
                           logits_indices, batch.table_rows[batch.sample_index])
        # The step's sampling tensors are built now, while the forward pass runs, even when the sampling itself
        # must wait for a grammar bitmask: only the bitmask's upload is left for then.
        tensors, history = (None, []) if logits is None else self._sampling_tensors(logits, rows)
        if so.grammar_request_ids and so.grammar is None:
            # The forward pass is queued on the device; sample once the engine has the bitmask.
            return AwaitingGrammar(lambda grammar: self._sample_step(logits, rows, tensors, history, grammar))
        return self._sample_step(logits, rows, tensors, history, so.grammar)

    @torch.inference_mode()
    def _sample_step(self, logits: torch.Tensor | None, rows: SampledRows, tensors: SamplingTensors | None,
                     history: list[tuple[str, RequestState]], grammar: GrammarBitmask | None) -> StepOutput:
        """`tensors` is None on tensor-parallel ranks other than 0 (no logits); `history` holds the rows whose
        sampled tokens the runner must remember."""
        request_ids = [request_id for request_id, _ in rows.states]
        sampled = None  # stays None on tensor-parallel ranks other than 0
        if logits is not None:
            if grammar is not None:
                row_of = {request_id: row for row, request_id in enumerate(request_ids)}
                tensors.add_grammar([row_of[request_id] for request_id in grammar.request_ids], grammar.bitmask,
                                    self.device)
            if rows.drafts is None:
                sampled = self.sampler(logits, tensors)
            else:
                sampled = self.rejection_sampler(logits, tensors, DraftBatch.build(rows.drafts, self.device))
        proposals = {}
        if self.drafter is not None and sampled is not None:
            if rows.drafts is not None:
                self.drafter.accepted(rows.table_rows, rows.last_accepted_index(sampled, self.device))
            if rows.lookahead is not None:
                proposals = self._propose(rows, sampled)
        if rows.drafts is not None:
            # Speculative steps are applied before the next is scheduled: it holds no placeholder.
            self._last_sampled, self._last_rows = None, {}
        elif self._share_samples:
            ids = sampled.token_ids if sampled is not None else torch.empty(len(request_ids), dtype=torch.int64,
                                                                             device=self.device)
            self._last_sampled = broadcast_from_driver(ids)
        elif sampled is not None:
            self._last_sampled = sampled.token_ids
        if rows.drafts is None:
            self._last_rows = {request_id: row for row, request_id in enumerate(request_ids)}
        output = StepOutput(request_ids, sampled, self._host_tokens.take(),
                            (lambda result: record_tokens(history, result)) if history else ignore_result, rows.drafts,
                            proposals)
        if sampled is not None:
            self._unread = output
        return output

    def _propose(self, rows: SampledRows, sampled: SamplerOutput) -> dict[str, list[int]]:
        return rows.propose(self.drafter, sampled, self.requests.block_tables.table, self.inputs.attention,
                            self.device)

    def _sampling_tensors(self, logits: torch.Tensor, rows: SampledRows
                          ) -> tuple[SamplingTensors, list[tuple[str, RequestState]]]:
        """The sampling tensors of the step's logits rows (a speculating row has one logits row per draft plus
        one), and the (request id, state) of the rows that keep their token history."""
        owner, offset = rows.verification_rows()
        table_rows = rows.table_rows if owner is None else rows.table_rows[owner]  # SamplingTable rows
        columns, special_positions, any_history = self.requests.sampling_table.gather(table_rows)
        if self._unread is not None and any_history:
            # Penalties and min_tokens read each row's output so far: the last step's tokens must be in.
            self._unread.result()
        self._unread = None
        special, history = rows.special_rows(special_positions.tolist(), owner, offset)
        tensors = SamplingTensors.from_columns(columns, special, logits.shape[-1], self.device, self.eos_token_ids)
        return tensors, history

    def _unsampled_output(self, pooled: tuple[list[str], torch.Tensor] | None = None) -> StepOutput:
        """The output of a step that samples nothing (`pooled`: the pooling requests whose prompts ended)."""
        return StepOutput([], None, self._host_tokens.take(), ignore_result, pooled=pooled)
