"""Linear methods by name: `QuantConfig.method` → the `QuantMethod` class that stores and multiplies the weights.

The model constructor takes the checkpoint's `QuantConfig` (None: unquantized) and hands it to each linear layer
it builds; the layer asks `linear_method(quant_config)` for its method. A layer that must stay unquantized
whatever the checkpoint says is built with `quant_config=None`. Nothing is read from a global.

Recipe: add a quantization format (three files, plus tests).
1. `batchllm/model/quantization/<format>.py`: a `QuantMethod` subclass (`method.py` states the contract):
   `create_weights` registers the layer's parameters with their `weight_loader`s (the layer's dense
   `weight_loader` for tensors split like the weight's rows, or the method's own using the layer's
   `output_part(shard_id)` / `input_part()`), `apply`, `process_after_loading`, `dequantized_weight`, and the
   checkpoint side: `weight_tensors` / `companion_tensors`, `read_weight` (the checkpoint's tensors → the
   method's parts) and `quantize_weight` (random weights for `load_format="dummy"`).
2. This file: one line in `LINEAR_METHODS`, `"<method>": <Class>`.
3. `batchllm/model/quantization/formats.py`: a reader of the producer's `quantization_config` (config.json) that
   returns `QuantConfig("<method>", ...)`, one line in its `FORMATS` table (the key is config.json's
   `quant_method`, which is also what users pass as `quantization=`), and a sentence in `SUPPORTED`.
A method whose settings `QuantConfig` does not hold yet also adds fields to `config.py`.
A new checkpoint layout of an existing method (another integer packing, another FP8 scale layout) changes only
that method's checkpoint reader (`int_checkpoint.py`, `checkpoint.py`) and `formats.py`.
"""

from __future__ import annotations

from batchllm.model.quantization.config import FP8, INT, MXFP4, QuantConfig
from batchllm.model.quantization.fp8_method import Fp8LinearMethod
from batchllm.model.quantization.int_method import IntLinearMethod
from batchllm.model.quantization.method import QuantMethod
from batchllm.model.quantization.unquantized import UnquantizedLinearMethod

UNQUANTIZED = "unquantized"
LINEAR_METHODS: dict[str, type[QuantMethod]] = {
    UNQUANTIZED: UnquantizedLinearMethod,
    FP8: Fp8LinearMethod,
    INT: IntLinearMethod,
    # MXFP4 quantizes MoE experts only (quantization/experts.py): gpt-oss's checkpoints keep attention, the router,
    # the embeddings and lm_head in bf16, and quantization="mxfp4" leaves a model's linear layers as they are.
    MXFP4: UnquantizedLinearMethod,
}


def linear_method(quant_config: QuantConfig | None) -> QuantMethod:
    """The method of a linear layer built with `quant_config` (None: unquantized)."""
    name = UNQUANTIZED if quant_config is None else quant_config.method
    method_class = LINEAR_METHODS.get(name)
    if method_class is None:
        raise ValueError(f"quantization method {name!r} has no linear method; registered: "
                         f"{', '.join(repr(known) for known in LINEAR_METHODS)}")
    return method_class(quant_config)
