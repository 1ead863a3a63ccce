"""Multi-LoRA's request type (no torch here). Adapter loading: `model/lora_adapter.py`; the device slots and
the batched delta: `model/layers/lora.py`; slot assignment per step: `executor/lora_slots.py`."""
