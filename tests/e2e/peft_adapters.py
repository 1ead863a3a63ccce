"""LoRA adapters made with PEFT for a given base model, and PEFT's greedy tokens with each: the references of the
multi-LoRA tests (random non-zero A and B, so that every delta counts; saved as PEFT writes them)."""

from __future__ import annotations

from pathlib import Path

import torch

ADAPTERS = {  # name: (rank, alpha, target modules, rslora, PEFT's per-module patterns)
    # v_proj at rank 4 and layer 0's q_proj at alpha 4 (rank_pattern / alpha_pattern, regexes on module names).
    "qv": (8, 16, ["q_proj", "v_proj"], False,
           dict(rank_pattern={"v_proj": 4}, alpha_pattern={r"layers\.0\.self_attn\.q_proj": 4})),
    "all": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True, {}),
    "mlp": (16, 32, ["o_proj", "gate_proj", "up_proj", "down_proj"], False, {}),
}


def write_adapters(base: Path, root: Path) -> dict[str, Path]:
    """name → directory of each adapter of `ADAPTERS`, made for the model at `base`."""
    import peft
    from transformers import AutoModelForCausalLM

    dirs = {}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for seed, (name, (rank, alpha, targets, rslora, patterns)) in enumerate(ADAPTERS.items()):
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                 lora_dropout=0.0, task_type="CAUSAL_LM", **patterns)
        model = peft.get_peft_model(model, config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:  # B is zero at PEFT's init: both halves random, so every delta counts
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
        model.save_pretrained(root / name)
        dirs[name] = root / name
        model = model.unload()  # the base model again, without this adapter's layers
    return dirs


def peft_greedy_tokens(base: Path, adapter_dirs: dict[str, Path], prompts: list[list[int]],
                       max_new: int) -> dict[tuple[int, str | None], list[int]]:
    """(prompt index, adapter name or None) → PEFT's greedy new tokens, one prompt at a time."""
    import peft
    from transformers import AutoModelForCausalLM

    names = list(adapter_dirs)
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                           adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.eval()
    reference = {}
    with torch.inference_mode():
        for name in [None, *names]:
            for i, prompt in enumerate(prompts):
                ids = torch.tensor([prompt])
                kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False)
                if name is None:
                    with model.disable_adapter():
                        out = model.generate(input_ids=ids, **kwargs)
                else:
                    model.set_adapter(name)
                    out = model.generate(input_ids=ids, **kwargs)
                reference[(i, name)] = out[0, len(prompt):].tolist()
    return reference
