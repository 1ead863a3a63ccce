"""Phi-3 / Phi-4 (`Phi3ForCausalLM`): the Llama decoder, read from checkpoints whose q/k/v and gate/up are fused.

Everything else that differs is in the config (`phi3_config.py`: LongRoPE, partial rotary, the window on every
layer), which `LlamaForCausalLM` already follows.
"""

from __future__ import annotations

from batchllm.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint stores each fused layer as one tensor: `qkv_proj.weight` is q's rows, then k's, then v's;
    # `gate_up_proj.weight` gate's, then up's. The loader cuts it into the layer's shards (see loader.py), so
    # tensor parallelism and quantization shard each part as they do Llama's separate tensors.
    packed_modules_mapping: dict = {}
    fused_checkpoint_modules = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}
