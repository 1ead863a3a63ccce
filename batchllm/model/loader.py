"""Build a model and fill its weights from a local safetensors checkpoint (or with seeded random values)."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Hashable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from batchllm.model.checkpoint_tensor import CheckpointSlice, copy_checked
from batchllm.model.config import ModelConfig, architecture_of, read_hf_config
from batchllm.model.default_model import default_model_path
from batchllm.model.layers.fused_moe import expert_checkpoint_name, expert_target
from batchllm.model.layers.norm import RMSNorm
from batchllm.model.quantization import check_on_load, resolve_quantization
from batchllm.model.quantization.checkpoint import kv_scale_target
from batchllm.model.quantization.config import MXFP4
from batchllm.model.quantization.unquantized import check_plain_tensor
from batchllm.model.registry import get_model_class

LOAD_FORMATS = ("auto", "dummy")
# Tensors some checkpoints carry that we derive ourselves instead of loading.
_UNUSED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_DUMMY_STD = 0.02


def resolve_model_path(model: str | Path | None) -> Path:
    """The local model directory for a user's `model` argument; None means the default model.

    Nothing is ever downloaded: a Hub repo id that is not an existing directory is an error.
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {str(model)!r} is not a local directory. batchllm never downloads models: pass the path of "
            f"an HF checkpoint directory (config.json + *.safetensors), e.g. one fetched with "
            f"`huggingface-cli download <repo> --local-dir <dir>`, or leave out model= for the default model."
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json; is it an HF checkpoint directory?")
    return path


def load_model(
    path: str | Path,
    device: str | torch.device,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for the checkpoint at `path` on `device` in `dtype`, with its weights loaded.

    `load_format="auto"` reads `*.safetensors` (memory-mapped; pickled checkpoints are never opened).
    `load_format="dummy"` needs only config.json and fills the weights with seeded random values
    (normal(0, 0.02), norms the identity): right shapes and speed, meaningless text.

    `quantization="fp8"` quantizes the decoder's linear layers on load (see `batchllm.model.quantization`);
    a checkpoint whose config.json carries a `quantization_config` (FP8, GPTQ, AWQ, compressed-tensors) is read
    in its own format either way. Random weights may also be "gptq" / "awq" / "compressed-tensors": 4-bit,
    groups of 128, the normal values above rounded to nearest.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = Path(path)
    hf_config = read_hf_config(path)
    model_class = get_model_class(architecture_of(hf_config))  # before parsing, so the error is about support
    config = ModelConfig.from_hf_dict(hf_config)
    quant = resolve_quantization(hf_config, quantization)
    check_on_load(quant, quantization, load_format)
    if quant is not None and quant.method == MXFP4 and config.moe is None:
        raise ValueError(f"quantization='mxfp4' quantizes the experts of MoE models, and {config.architecture} has "
                         f"none (its linear layers would stay unquantized)")
    # Parameters are created uninitialised, directly on the device and in the target dtype.
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config, quant)
    with torch.no_grad():
        if load_format == "dummy":
            fill_dummy_weights(model, seed, dtype)
        else:
            load_checkpoint_weights(model, path, config)
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_after_loading(module)
    return model.eval(), config


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
    """Loader for parameters that map one-to-one onto a checkpoint tensor."""
    copy_checked(param.data, loaded_weight)


def load_checkpoint_weights(model: nn.Module, path: Path, config: ModelConfig, ignore: tuple[str, ...] = ()) -> None:
    """Every `*.safetensors` tensor of `path` into `model`'s parameter of the same name (fused ones through
    `packed_modules_mapping`), checked for shape; a missing or unexpected tensor is an error, except the
    names in `ignore`, which the caller reads itself. A linear layer's weight goes through its `quant_method`,
    which reads the weight's other tensors (scales, zero points) itself."""
    packed: dict[str, tuple[str, Hashable]] = getattr(model, "packed_modules_mapping", {})
    fused: dict[str, tuple[Hashable, ...]] = getattr(model, "fused_checkpoint_modules", {})
    # MoE families: an expert's projection name → its part of the stacked experts (layers/fused_moe.py).
    experts: dict[str, str] = getattr(model, "expert_checkpoint_projections", {})
    held_elsewhere = getattr(model, "held_elsewhere", None)  # pipeline parallelism: another stage's tensors
    # Parts whose checkpoint names are their own (a vision tower's gate_proj is not the decoder's fused one).
    unpacked: tuple[str, ...] = getattr(model, "checkpoint_unpacked_prefixes", ())
    rename = _checkpoint_renamer(model)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[tuple[str, Hashable]] = set()
    unexpected: list[str] = []
    files = _checkpoint_files(path)
    with ExitStack() as stack:
        checkpoints = [stack.enter_context(safe_open(file, framework="pt", device="cpu")) for file in files]
        # Any tensor by (our) name, whichever file holds it: a weight's scales may sit in another shard.
        holder = {name: (checkpoint, stored) for checkpoint in checkpoints for stored in checkpoint.keys()
                  if (name := rename(stored)) is not None}

        def read(name: str, required: bool = True) -> torch.Tensor | None:
            if name not in holder:
                if not required:
                    return None
                raise ValueError(f"needs the tensor {name}, which the checkpoint does not have")
            checkpoint, stored = holder[name]
            return checkpoint.get_tensor(stored)

        for file, checkpoint in zip(files, checkpoints, strict=True):
            for stored in checkpoint.keys():
                name = rename(stored)
                if (name is None or name.endswith(_UNUSED_SUFFIXES) or name in ignore
                        or (name == "lm_head.weight" and config.tie_word_embeddings)
                        or (held_elsewhere is not None and held_elsewhere(name))):
                    continue
                kv_scale = kv_scale_target(name)
                if kv_scale is not None and kv_scale[0] in modules:
                    setattr(modules[kv_scale[0]], kv_scale[1], float(read(name)))
                    continue
                whole = CheckpointSlice(checkpoint.get_slice(stored))
                expert = expert_target(name, experts) if experts else None
                if expert is not None:  # one expert's projection, into the layer's stacked parameters
                    module_name, kind, shard_id = expert
                    try:
                        filled = modules[module_name].load_expert_tensor(name, kind, whole, read, shard_id)
                    except ValueError as exc:
                        raise ValueError(f"{file.name}: {stored}: {exc}") from None
                    loaded.update((f"{module_name}.{part}", shard_id) for part in filled)
                    continue
                shards = _shards(name, whole, {} if name.startswith(unpacked) else packed, fused, modules)
                for target, shard_id, tensor in shards:
                    module_name, _, kind = target.rpartition(".")
                    layer = modules.get(module_name)
                    method = getattr(layer, "quant_method", None)
                    try:
                        if method is not None and kind in method.companion_tensors:
                            continue  # read with its weight
                        if method is not None and kind in method.weight_tensors:
                            parts = method.read_weight(name, tensor, read, layer.checkpoint_shapes[shard_id])
                            for part, value in parts.items():
                                param = getattr(layer, part)
                                param.weight_loader(param, value, shard_id)
                                loaded.add((f"{module_name}.{part}", shard_id))
                            continue
                        param = params.get(target)
                        if param is None:
                            unexpected.append(name)
                            continue
                        shapes = getattr(param, "checkpoint_shapes", {shard_id: param.shape})
                        check_plain_tensor(tensor, shapes[shard_id])
                        getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
                    except ValueError as exc:
                        raise ValueError(f"{file.name}: {stored}: {exc}") from None
                    loaded.add((target, shard_id))
    # A scale loaded with its weight is missing only if the weight is: the error names the weight.
    expected = {(name, shard) for name, p in params.items() if not getattr(p, "filled_with_weight", False)
                for shard in getattr(p, "checkpoint_shapes", [None])}
    missing = sorted(expert_checkpoint_name(name, shard, experts) if isinstance(shard, tuple)
                     else _checkpoint_name_for(name, shard, packed) for name, shard in expected - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match {config.architecture}: "
            + (f"missing tensors: {', '.join(missing)}. " if missing else "")
            + (f"unexpected tensors: {', '.join(sorted(unexpected))}." if unexpected else "")
        )


def _checkpoint_renamer(model: nn.Module) -> Callable[[str], str | None]:
    """A checkpoint tensor's name → the name the model's parameters go by, or None for a tensor of a part the
    model does not serve. A model class whose checkpoints nest it in a bigger model (the language model of a
    multimodal checkpoint) lists `checkpoint_prefix_renames` (stored prefix → ours) and
    `checkpoint_skipped_prefixes` (the other parts), and one whose checkpoints name a module otherwise
    `checkpoint_module_renames` (Mixtral's `.block_sparse_moe.` → `.mlp.`); any other class reads names as stored.
    `checkpoint_parts` (our module prefix → a function naming a stored tensor within that module, or None when it
    is not one of its) comes first: a part whose checkpoints spell it several ways (Gemma 3's vision tower)."""
    parts: dict[str, Callable[[str], str | None]] = getattr(model, "checkpoint_parts", {})
    renames: dict[str, str] = getattr(model, "checkpoint_prefix_renames", {})
    module_renames: dict[str, str] = getattr(model, "checkpoint_module_renames", {})  # anywhere in the name
    skipped: tuple[str, ...] = getattr(model, "checkpoint_skipped_prefixes", ())

    def rename(stored: str) -> str | None:
        for ours, name_in_part in parts.items():
            name = name_in_part(stored)
            if name is not None:
                return ours + name
        if stored.startswith(skipped):
            return None
        for theirs, ours in module_renames.items():
            stored = stored.replace(theirs, ours)
        for prefix, ours in renames.items():
            if stored.startswith(prefix):
                return ours + stored[len(prefix):]
        return stored

    return rename


def _checkpoint_files(path: Path) -> list[Path]:
    # The index is authoritative: some repos also ship a consolidated copy that must not be read twice.
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {path}; batchllm loads safetensors checkpoints only "
            f"(use load_format='dummy' for random weights)"
        )
    return files


def _shards(name: str, tensor: CheckpointSlice, packed: dict[str, tuple[str, Hashable]],
            fused: dict[str, tuple[Hashable, ...]], modules: dict[str, nn.Module]
            ) -> Iterator[tuple[str, Hashable, CheckpointSlice]]:
    """(parameter name, shard id, tensor) of checkpoint tensor `name`: one entry, or for the tensor of a layer the
    checkpoint stores fused (a module of the model's `fused_checkpoint_modules`, e.g. Phi-3's `qkv_proj`), one per
    shard, its rows cut by the layer's `checkpoint_shapes` in the order the mapping lists the shards."""
    module_name, _, kind = name.rpartition(".")
    shards = fused.get(module_name.rpartition(".")[2])
    layer = modules.get(module_name)
    if shards is None or layer is None:  # no layer: another pipeline stage's, skipped by the caller
        yield *_param_name_for(name, packed), tensor
        return
    if kind not in ("weight", "bias"):
        raise ValueError(f"{name}: only a plain weight or bias of a fused layer can be cut into its shards, not a "
                         f"quantized checkpoint's {kind!r}")
    rows = [layer.checkpoint_shapes[shard][0] for shard in shards]
    if tensor.shape[0] != sum(rows):
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(tensor.shape)}, expected {sum(rows)} rows "
                         f"(its shards {', '.join(map(str, shards))} have {', '.join(map(str, rows))})")
    for shard, size, start in zip(shards, rows, [sum(rows[:i]) for i in range(len(rows))], strict=True):
        yield name, shard, tensor.rows(start, size)


def _param_name_for(checkpoint_name: str, packed: dict[str, tuple[str, Hashable]]) -> tuple[str, Hashable]:
    """`model.layers.0.self_attn.k_proj.weight` → (`model.layers.0.self_attn.qkv_proj.weight`, "k")."""
    *prefix, module, kind = checkpoint_name.split(".")
    if module in packed:
        fused, shard_id = packed[module]
        return ".".join([*prefix, fused, kind]), shard_id
    return checkpoint_name, None


def _checkpoint_name_for(param_name: str, shard_id: Hashable, packed: dict[str, tuple[str, Hashable]]) -> str:
    """Inverse of `_param_name_for`, so errors name the tensors a user can look for in the checkpoint."""
    if shard_id is None:
        return param_name
    *prefix, fused, kind = param_name.split(".")
    # A fused checkpoint tensor (`fused_checkpoint_modules`) goes by our name.
    module = next((hf for hf, target in packed.items() if target == (fused, shard_id)), fused)
    return ".".join([*prefix, module, kind])


def fill_dummy_weights(model: nn.Module, seed: int, dtype: torch.dtype) -> None:
    """normal(0, 0.02) weights and identity norms (1; 0 for Gemma's `1 + w` norms), generated per checkpoint
    tensor from a seed derived from its name, then sliced by the parameter's own loader: every tensor-parallel
    size (and every data-parallel replica) gets the same model, and a rank only ever holds one full tensor at a
    time. A linear layer's `quant_method` quantizes the same values the unquantized model gets, so the two can
    be compared."""
    norm_weights = {id(module.weight): module.identity_weight for module in model.modules()
                    if isinstance(module, RMSNorm)}  # Gemma's norms included
    filled: set[int] = set()  # the parameters of linear layers' weights, filled through their method
    for module_name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if method is None:
            continue
        device = next(layer.parameters()).device
        for shard_id, shape in layer.checkpoint_shapes.items():
            generator = _dummy_generator(device, seed, f"{module_name}.weight", shard_id)
            full = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, _DUMMY_STD, generator=generator)
            for part, value in method.quantize_weight(full).items():
                param = getattr(layer, part)
                param.weight_loader(param, value, shard_id)
                filled.add(id(param))
    for name, param in model.named_parameters():
        if id(param) in norm_weights:
            param.fill_(norm_weights[id(param)])
            continue
        if id(param) in filled or getattr(param, "filled_with_weight", False):
            continue
        weight_loader = getattr(param, "weight_loader", default_weight_loader)
        for shard_id, shape in getattr(param, "checkpoint_shapes", {None: param.shape}).items():
            generator = _dummy_generator(param.device, seed, name, shard_id)
            full = torch.empty(shape, dtype=dtype, device=param.device).normal_(0.0, _DUMMY_STD, generator=generator)
            weight_loader(param, full, shard_id)


def _dummy_generator(device: torch.device, seed: int, name: str, shard_id: Hashable) -> torch.Generator:
    """The generator of parameter `name`'s HF shard `shard_id`: the same on every rank and replica."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed * 1_000_003 + zlib.crc32(f"{name}:{shard_id}".encode()))
    return generator


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
