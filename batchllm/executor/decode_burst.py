"""A decode burst on the device (engine/decode_burst.py): `num_steps` forward passes over the same decode rows,
each pass's input the token the one before it sampled, read on the device as an asynchronous step's placeholder
is. The host prepares each pass (positions and slots one further; a CUDA graph replays it) but schedules and
applies the burst once. Mixed into `ModelRunner` (model_runner.py), whose state it reads and updates.
"""

from __future__ import annotations

import dataclasses

import torch

from batchllm.distributed.parallel_state import broadcast_from_driver
from batchllm.engine.interfaces import SchedulerOutput
from batchllm.executor.input_batch import InputBatch
from batchllm.executor.sampled_rows import SampledRows
from batchllm.executor.step_batch import RequestStates, StepBatch
from batchllm.executor.step_output import HostTokenBuffers, StepOutput, ignore_result
from batchllm.model.layers.sampler import Sampler, SamplerOutput


class DecodeBurst:
    device: torch.device
    model: torch.nn.Module
    sampler: Sampler
    inputs: InputBatch
    requests: RequestStates
    _host_tokens: HostTokenBuffers
    _last_sampled: torch.Tensor | None
    _last_rows: dict[str, int]
    _unread: StepOutput | None

    # And ModelRunner's `_prepare` and `_forward`, StepSampling's `_sampling_tensors`.

    def _execute_burst(self, so: SchedulerOutput, batch: StepBatch) -> StepOutput:
        num_rows = len(batch.sampled_states)
        if (num_rows != len(batch.token_ids) or batch.drafts is not None or batch.lookahead is not None
                or batch.pool_rows or batch.lora_rows or batch.mm_rows):
            raise RuntimeError("a decode burst holds only decode rows of plain sampling; this is a bug")
        # The passes after the first: every row's input is its sample of the pass before (row i of `_last_sampled`).
        rows = list(range(num_rows))
        follow = dataclasses.replace(batch, token_ids=[0] * num_rows, new_rows=[False] * num_rows,
                                     placeholder_slots=rows, placeholder_rows=rows)
        tensors = None
        has_logits = False  # tensor-parallel ranks other than 0 sample nothing
        tokens: list[torch.Tensor] = []
        for step in range(so.num_steps):
            if step:
                follow.num_computed = batch.num_computed + step
            inputs = self._prepare(follow if step else batch)
            hidden = self._forward(inputs)
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            has_logits = logits is not None
            if has_logits and tensors is None:  # the same rows and parameters in every pass
                sampled_rows = SampledRows(batch.sampled_states, batch.sample_positions, None, None, hidden,
                                           inputs.logits_indices, batch.table_rows[batch.sample_index])
                tensors, _ = self._sampling_tensors(logits, sampled_rows)
            ids = (self.sampler(logits, tensors).token_ids if has_logits
                   else torch.empty(num_rows, dtype=torch.int64, device=self.device))
            # Tensor-parallel ranks other than 0 have no logits: each pass's inputs need rank 0's samples.
            self._last_sampled = broadcast_from_driver(ids)
            tokens.append(self._last_sampled)
        request_ids = [request_id for request_id, _ in batch.sampled_states]
        self._last_rows = {request_id: row for row, request_id in enumerate(request_ids)}
        # Pass by pass: the first `num_rows` ids are the first pass's.
        sampled = (SamplerOutput(torch.cat(tokens), None, None, None, None, [None] * num_rows * so.num_steps)
                   if has_logits else None)
        output = StepOutput(request_ids, sampled, self._host_tokens.take(), ignore_result, num_steps=so.num_steps)
        self._unread = output
        return output
