"""FP8 on a GPU without FP8 tensor cores is refused with a message naming what is supported."""

from __future__ import annotations

import pytest
import torch

from batchllm.model.quantization import fp8


def test_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a GPU with FP8 tensor cores.*A100 is sm_80"
                                         r".*Supported here: quantization=None and kv_cache_dtype='auto'"):
        fp8.check_fp8_device(torch.device("cuda"), "kv_cache_dtype='fp8'")


def test_fp8_capable_gpus_and_the_cpu_pass(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    fp8.check_fp8_device(torch.device("cuda"), "quantization='fp8'")
    fp8.check_fp8_device(torch.device("cpu"), "quantization='fp8'")
