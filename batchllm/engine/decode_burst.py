"""Decode bursts: one scheduled step that runs several decode forward passes.

A decode step of a small model costs the host about as much as the device: scheduling, the stop checks and the
bookkeeping of every row run in Python once per step. When every running row is a plain decode row, the scheduler
gives each row `k` tokens at once (`SchedulerOutput.num_steps`): it allocates their K/V slots and counts them
pending, as it does a single pending token under asynchronous scheduling. The runner then runs `k` forward
passes, each sampling on the device the token the next one reads (a placeholder, as an asynchronous step's first
token is), and returns the `k` tokens of each row together. Applying them appends them one at a time with the
usual stop checks, so the outputs are those of `k` single steps; a row that stops inside a burst had its later
tokens computed in vain, and a row with fewer tokens left than `k` wastes the rest of the burst.

A burst runs only where nothing needs the host between the passes: no prompt left to prefill, nobody waiting who
could be admitted (a free seat, and room in the pool as far as the last admission found: it found none, and no
request has ended since), no grammar, penalties, min_tokens, logprobs, seeded generator, adapter, image or pooling
in any row. Otherwise the step is an ordinary one.
"""

from __future__ import annotations

from batchllm.config import SchedulerConfig
from batchllm.engine.request import Request


def burst_length(running: list[Request], num_waiting: int, config: SchedulerConfig,
                 waiting_for_room: bool = False) -> int:
    """The tokens each row gets in the next step: `config.num_decode_steps` where a burst may run (see the module
    docstring), capped by what any row can still use (its max_tokens, the model length); 1 otherwise.
    `waiting_for_room`: the waiting rows' head found the pool too short, and no request has ended since."""
    steps = config.num_decode_steps
    admissible = num_waiting and len(running) < config.max_num_seqs and not waiting_for_room
    if steps == 1 or admissible or not running:
        return 1
    max_model_len = config.max_model_len
    longest = 0  # the most tokens any row still needs
    for request in running:
        if not request.burstable:
            return 1
        with_pending = len(request.token_ids) + request.num_pending_tokens
        if with_pending - request.num_computed_tokens != 1:
            return 1  # a prompt chunk left to compute, or a recompute after preemption
        if with_pending >= max_model_len or (request.num_pending_tokens and request.surely_finishes):
            continue  # the step leaves it out
        steps = min(steps, max_model_len - with_pending)
        max_tokens = request.sampling_params.max_tokens
        left = (max_model_len if max_tokens is None
                else max_tokens - (with_pending - request.num_prompt_tokens))
        longest = max(longest, left)
    return max(1, min(steps, longest))
