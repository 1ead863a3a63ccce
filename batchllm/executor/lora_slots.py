"""Which adapter sits in which device slot, and the step's `LoRABatch`.

The layers hold `max_loras` slots (`model/layers/lora.py`). A step's adapters are made resident before its
forward pass, and its segments (which flat tokens run under which slot) are uploaded into fixed buffers
that the CUDA graphs read. An adapter already in a slot stays there; another is copied in from the CPU
(read from disk once) over the least recently used adapter that no row of the step needs. The scheduler admits at most
`max_loras` distinct adapters among the running requests, so a step always fits. Copies are queued on the
device's stream behind the step in flight, so replacing a slot never changes a step already launched.
Under tensor parallelism every rank holds its part of each adapter, split like the base weights
(`_Linear.lora_shard`), and reads the adapter from disk itself.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from batchllm.executor.staged_buffer import StagedBuffer
from batchllm.lora.request import LoRARequest
from batchllm.model.config import ModelConfig
from batchllm.model.layers.lora import LoRABatch, LoRASlots
from batchllm.model.lora_adapter import LoRAAdapter, LoRAError, load_adapter


class LoRASlotManager:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, max_loras: int, max_rank: int,
                 max_num_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.max_loras, self.max_rank, self.device = config, max_loras, max_rank, device
        # The step's segments, in fixed buffers (`batch`); an event guards the host side as in InputBatch.
        self._tokens = StagedBuffer.create((max_num_tokens,), torch.int32, device)
        self._starts = StagedBuffer.create((max_loras + 1,), torch.int32, device)
        self._arange = np.arange(max_num_tokens, dtype=np.int32)
        self._copied = None if device.type == "cpu" else torch.cuda.Event()
        self.step_batch = LoRABatch(self._tokens.device, self._starts.device)
        # (layer, module) → (its linear layer, its sub-projection there, its HF shard id in the layer)
        self._targets: dict[tuple[int, str], tuple[torch.nn.Module, int, object]] = {}
        for index, layer in enumerate(model.model.layers):
            qkv, o_proj = layer.self_attn.qkv_proj, layer.self_attn.o_proj
            q, kv = qkv.q_size, qkv.kv_size
            layouts = [(qkv, [(0, q), (q, kv), (q + kv, kv)], {"q_proj": "q", "k_proj": "k", "v_proj": "v"}),
                       (o_proj, [(0, o_proj.output_size)], {"o_proj": None})]
            if hasattr(layer.mlp, "gate_up_proj"):  # a dense MLP; a MoE block (model/moe.py) takes no adapter
                gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
                layouts += [(gate_up, list(zip(gate_up.output_offsets, gate_up.output_sizes)),
                             {"gate_proj": 0, "up_proj": 1}),
                            (down, [(0, down.output_size)], {"down_proj": None})]
            for linear, slices, modules in layouts:
                linear.lora = LoRASlots(slices, linear.input_size, linear.output_size, max_loras, max_rank, dtype,
                                        device)
                for slice_index, (module, shard_id) in enumerate(modules.items()):
                    self._targets[(index, module)] = (linear, slice_index, shard_id)
        self._layers = {linear.lora for linear, _, _ in self._targets.values()}
        self._resident: OrderedDict[tuple[str, int], int] = OrderedDict()  # cache key → slot, oldest use first
        self._loaded: dict[tuple[str, int], LoRAAdapter] = {}
        self.slot_loads = 0  # adapters copied into a slot so far (a measure of swapping)

    def batch(self, rows: list[tuple[LoRARequest, int, int]]) -> LoRABatch | None:
        """The step's segments, given `(adapter, first flat token, number of tokens)` per row under an adapter:
        uploaded into the fixed buffers of `self.step_batch` (all segments empty when `rows` is), which the
        decode CUDA graphs read. Returns that batch, or None for a step without adapter rows (an eager step
        then skips the LoRA kernels)."""
        spans: dict[int, list[tuple[int, int]]] = {}
        needed = {lora.cache_key for lora, _, _ in rows}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step uses {len(needed)} adapters, more than max_loras={self.max_loras}; "
                               f"this is a scheduler bug")
        for lora, first, count in rows:
            spans.setdefault(self._slot(lora, needed), []).append((first, count))
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the host buffers
        starts, tokens = self._starts.np, self._tokens.np
        end = 0
        for slot in range(self.max_loras):
            starts[slot] = end
            for first, count in spans.get(slot, ()):
                tokens[end:end + count] = self._arange[first:first + count]
                end += count
        starts[self.max_loras] = end
        self._tokens.upload(end)
        self._starts.upload(self.max_loras + 1)
        if self._copied is not None:
            self._copied.record()
        return self.step_batch if rows else None

    def _slot(self, lora: LoRARequest, needed: set[tuple[str, int]]) -> int:
        key = lora.cache_key
        slot = self._resident.get(key)
        if slot is not None:
            self._resident.move_to_end(key)
            return slot
        if len(self._resident) < self.max_loras:
            slot = len(self._resident)
        else:
            victim = next(k for k in self._resident if k not in needed)
            slot = self._resident.pop(victim)
        self._write(slot, self._adapter(lora))
        self.slot_loads += 1
        self._resident[key] = slot
        return slot

    def _adapter(self, lora: LoRARequest) -> LoRAAdapter:
        adapter = self._loaded.get(lora.cache_key)
        if adapter is None:
            adapter = self._loaded[lora.cache_key] = load_adapter(lora, self.config, self.max_rank)
        return adapter

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer in self._layers:
            layer.clear(slot)
        for key, (a, b) in adapter.weights.items():
            if key not in self._targets:
                raise LoRAError(f"LoRA adapter targets layer {key[0]}'s {key[1]}, but that layer's MLP is a mixture "
                                f"of experts, which takes no adapter (its attention projections do)")
            linear, slice_index, shard_id = self._targets[key]
            linear.lora.write(slot, slice_index, *linear.lora_shard(shard_id, a, b))  # this rank's part, under TP
