"""Disaggregated prefill / decode: two engines, each on its own worker process (its own GPU, or a share of one),
driven by one loop. No torch here.

A request goes to the prefill engine as its prompt less the last token (kv_handoff.py says why), then to the
decode engine, which admits it with that K/V loaded from the shared buffer and generates. Each `step()` steps
both engines, each keeping a step in flight, so the prefill worker computes prompts while the decode worker
decodes. The loop offers `EngineCore`'s interface (`add_request`, `abort`, `step`, `has_unfinished`; `scheduler`,
`detokenizer` and `structured` are the decode engine's), so `LLM`, jobs and the server drive it unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from batchllm.engine.engine_core import EngineCore, FinishedRequest
from batchllm.engine.kv_handoff import DecodeKVCacheManager, Handoff, PrefillKVCacheManager, free_slots
from batchllm.engine.request import Request, RequestStatus
from batchllm.lora.request import LoRARequest
from batchllm.sampling_params import SamplingParams

# The prefill engine's one sample per prompt is thrown away: the cheapest there is.
_PREFILL_PARAMS = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


@dataclass(slots=True)
class _Pending:
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None
    arrival_time: float


class DisaggregatedEngineCore:
    def __init__(self, prefill: EngineCore, decode: EngineCore) -> None:
        self.prefill, self.decode = prefill, decode
        self.prefill_kv: PrefillKVCacheManager = prefill.scheduler.kv_cache  # type: ignore[assignment]
        self.decode_kv: DecodeKVCacheManager = decode.scheduler.kv_cache  # type: ignore[assignment]
        self.scheduler, self.detokenizer, self.structured = decode.scheduler, decode.detokenizer, decode.structured
        self._prefilling: dict[str, _Pending] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    fork_of: str | None = None, lora_request: LoRARequest | None = None, mm: Any = None,
                    error: str | None = None) -> None:
        """Queue a request. A prompt of one token, or one the decode engine will reject (too long), goes to the
        decode engine directly, as does a row the door failed (`error`). `fork_of` is not used: each sample is
        prefilled (the prefill engine's prefix cache computes a shared prompt once). Images (`mm`) are refused
        before they get here (`image_refusal`)."""
        if mm is not None:
            raise ValueError("disaggregated prefill / decode does not take images yet")
        max_model_len = self.scheduler.config.max_model_len
        if error is not None or len(prompt_token_ids) < 2 or len(prompt_token_ids) >= max_model_len:
            self.decode.add_request(request_id, prompt_token_ids, params, lora_request=lora_request, error=error)
            return
        if request_id in self._prefilling or request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if params.structured_outputs is not None and self.structured is None:
            raise ValueError("structured outputs need a tokenizer (the LLM was built with skip_tokenizer_init=True)")
        self.prefill.add_request(request_id, prompt_token_ids[:-1], _PREFILL_PARAMS, lora_request=lora_request)
        self._prefilling[request_id] = _Pending(list(prompt_token_ids), params, lora_request, time.perf_counter())

    def abort(self, request_id: str) -> Request | None:
        """As `EngineCore.abort`; a request still with the prefill engine ends there (its K/V copies, if under
        way, are dropped when their step is applied)."""
        pending = self._prefilling.pop(request_id, None)
        if pending is None:
            return self.decode.abort(request_id)
        if self.prefill.abort(request_id) is None:
            self.prefill_kv.sender.cancel(request_id)
        request = Request(request_id, pending.prompt_token_ids, pending.params, lora_request=pending.lora_request)
        request.status, request.finished_time = RequestStatus.FINISHED_ABORTED, time.perf_counter()
        return request

    def has_unfinished(self) -> bool:
        return bool(self._prefilling) or self.prefill.has_unfinished() or self.decode.has_unfinished()

    def step(self) -> list[FinishedRequest]:
        if self.prefill.has_unfinished() or self.prefill_kv.sender.has_pending():
            for ended in self.prefill.step():
                if ended.request.error is not None:  # rejected by the prefill engine: the decode engine says why
                    self._hand_over(Handoff(ended.request.request_id, 0, None))
            # The prompts whose K/V copies ran in a step the prefill engine has applied.
            for handoff in self.prefill_kv.sender.take_sent(self.prefill.in_flight_outputs()):
                self._hand_over(handoff)
        return self.decode.step()

    def _hand_over(self, handoff: Handoff) -> None:
        pending = self._prefilling.pop(handoff.request_id, None)
        if pending is None:  # aborted while its copies ran: they are done, and nobody reads them
            if handoff.slots:
                free_slots(self.prefill_kv.link, handoff.slots)
            return
        self.decode.add_request(handoff.request_id, pending.prompt_token_ids, pending.params,
                                lora_request=pending.lora_request)
        request = self.scheduler.requests.get(handoff.request_id)
        if request is not None:
            request.arrival_time = pending.arrival_time  # its time to first token counts the prefill
        if handoff.slots is None:
            self.decode_kv.handoff.recomputed += handoff.num_tokens > 0
        else:
            self.decode_kv.receiver.expect(handoff)

