"""The FP8 linear layers of the llama3-8b shape alone, at a step's token counts: where W5 / W7 steps spend GEMM time.

    python benchmarks/fp8_gemm.py                    # GPU: M 256 .. 4096 over qkv, o, gate_up, down

Per layer and token count M: `torch._scaled_mm` on pre-quantized activations (the GEMM alone), `fp8_linear` (the
engine's path: per-token activation quantization, then the same GEMM) and a bf16 `x @ w.t()`; then the down
projection with its SiLU-and-mul, unfused (the activation, then `fp8_linear` quantizing it) against the fused
activation that writes FP8 rows, and the qkv projection with its RMSNorm the same way. Each is timed as 50 calls
replayed from one CUDA graph (no launch gaps); TFLOP/s = 2 M N K over the time.
"""

from __future__ import annotations

import argparse

import torch

from batchllm.model.layers.activation import SiluAndMul
from batchllm.model.layers.norm import RMSNorm
from batchllm.model.quantization.fp8 import FP8_DTYPE, fp8_linear, quantize_fp8_per_channel

# (output features, input features) of one decoder layer's linear layers.
LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def graph_time_us(fn, calls: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    args = parser.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name())
    print(f"{'layer':8} {'M':>5} {'scaled_mm us':>12} {'TF/s':>6} {'fp8_linear us':>13} {'TF/s':>6} {'bf16 us':>8} "
          f"{'TF/s':>6}")
    totals: dict[int, list[float]] = {}
    for m in args.tokens:
        for name, (n, k) in LLAMA3_8B.items():
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q_weight, w_scale = quantize_fp8_per_channel(weight)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q_x, x_scale = x.to(FP8_DTYPE), torch.ones(m, 1, device="cuda", dtype=torch.float32)
            times = (graph_time_us(lambda: torch._scaled_mm(q_x, q_weight.t(), scale_a=x_scale,
                                                            scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)),
                     graph_time_us(lambda: fp8_linear(x, q_weight, w_scale, None)),
                     graph_time_us(lambda: x @ weight.t()))
            tflop = 2 * m * n * k / 1e6  # TFLOP/s when divided by microseconds
            print(f"{name:8} {m:5d}" + "".join(f" {t:12.1f} {tflop / t:6.0f}" for t in times))
            total = totals.setdefault(m, [0.0, 0.0, 0.0, 0.0])
            for i, t in enumerate((*times, tflop)):
                total[i] += t
    for m, (mm, linear, bf16, tflop) in totals.items():
        print(f"one layer, M={m}: scaled_mm {mm:.0f} us ({tflop / mm:.0f} TF/s), fp8_linear {linear:.0f} us "
              f"({tflop / linear:.0f}), bf16 {bf16:.0f} us ({tflop / bf16:.0f})")
    # The down projection with the activation before it: SiLU-and-mul, then fp8_linear quantizing its output, against
    # the fused SiLU-and-mul that writes FP8 rows (what LlamaMLP runs for an FP8 down projection).
    n, k = LLAMA3_8B["down"]
    q_weight, w_scale = quantize_fp8_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    for m in args.tokens:
        gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
        unfused = graph_time_us(lambda: fp8_linear(SiluAndMul()(gate_up), q_weight, w_scale, None))
        fused = graph_time_us(lambda: fp8_linear(SiluAndMul.quantized(gate_up), q_weight, w_scale, None))
        print(f"activation + down, M={m}: unfused {unfused:.1f} us, fused {fused:.1f} us ({unfused / fused:.2f}x)")
    # The qkv projection with the norm before it (residual add included): the norm, then fp8_linear quantizing its
    # output, against the norm that writes FP8 rows (what LlamaDecoderLayer runs for an FP8 qkv or gate_up).
    n, k = LLAMA3_8B["qkv"]
    q_weight, w_scale = quantize_fp8_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    norm = RMSNorm(k).to("cuda", torch.bfloat16)
    for m in args.tokens:
        x, residual = torch.randn(2, m, k, device="cuda", dtype=torch.bfloat16)
        unfused = graph_time_us(lambda: fp8_linear(norm(x, residual)[0], q_weight, w_scale, None))
        fused = graph_time_us(lambda: fp8_linear(norm.quantized(x, residual)[0], q_weight, w_scale, None))
        print(f"norm + qkv, M={m}: unfused {unfused:.1f} us, fused {fused:.1f} us ({unfused / fused:.2f}x)")


if __name__ == "__main__":
    main()
