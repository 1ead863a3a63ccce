"""Images in, captions out (issue 45's benchmark): rows/s of `LLM.generate` on one image per row against HF
`generate` on the same processor outputs, random weights of the Qwen2.5-VL-7B shape (GPU).

    python benchmarks/vision.py --rows 1000 --max-tokens 128 --hf-rows 64 --out $OUT

Every row: one synthetic 448 x 448 JPEG (gradients and rectangles drawn from the row's seed, about 20 KB) and the
prompt "Describe the image." around one `<|image_pad|>` (Qwen2.5-VL's chat layout as token ids; no tokenizer needs
to travel), greedy, `ignore_eos`, `max_tokens` new tokens. Runs: (a) 1,000 distinct images; (b) the same rows over
10 distinct images repeated (the encoder-output and prefix caches at work); (c) HF transformers' model of the same
config (its own random init, bf16, SDPA), batched `generate` over `--hf-rows` rows, batch `--hf-batch`: rows/s. The
encoder's share of (a)'s wall is timed with CUDA events around the model's `encode_images` (no syncs added).
`prepare_s`: decoding and preprocessing the images on the host before the first step.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import subprocess
import sys
import time

import numpy as np
import torch
from PIL import Image, ImageDraw
from shapes import SHAPES, hf_config, make_shape_dir
from throughput import git_sha, hardware, save_record

from batchllm import LLM, SamplingParams

SIDE = 448
PROMPT_BEFORE = [151644, 872, 198, 151652]  # <|im_start|>user\n<|vision_start|>
PROMPT_AFTER = [151653, 74785, 279, 2168, 13, 151645, 198, 151644, 77091, 198]  # <|vision_end|>Describe the image.…


def synthetic_jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, SIDE)[None, :, None]
    y = np.linspace(0, 1, SIDE)[:, None, None]
    base = (rng.random(3) * x + rng.random(3) * y) * 255 / 2
    image = Image.fromarray(base.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x0, y0 = rng.integers(0, SIDE - 64, 2)
        draw.rectangle([int(x0), int(y0), int(x0) + int(rng.integers(16, 64)), int(y0) + int(rng.integers(16, 64))],
                       fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


class GpuBusySampler:
    """The GPU's idle share over a `with` block: NVML's utilisation (the share of each ~1/6 s sample period in which
    a kernel ran) read every 100 ms by `nvidia-smi`, averaged; None where nvidia-smi is missing."""

    def __enter__(self) -> GpuBusySampler:
        self.idle_share = None
        query = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100", "-i",
                 str(torch.cuda.current_device())]
        try:
            self.process = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.process = None
        return self

    def __exit__(self, *exc) -> None:
        if self.process is None:
            return
        self.process.terminate()
        samples = [int(line) for line in self.process.communicate()[0].split() if line.strip().isdigit()]
        if samples:
            self.idle_share = 1 - sum(samples) / (100 * len(samples))


def run_ours(directory, images: list[bytes], args) -> dict:
    image_token = SHAPES[args.shape]["image_token_id"]
    llm = LLM(model=str(directory), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              gpu_memory_utilization=0.85, max_num_seqs=args.max_num_seqs)
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    encode = llm.runner.model.encode_images

    def timed_encode(batch):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        rows = encode(batch)
        end.record()
        events.append((start, end))
        return rows

    llm.runner.model.encode_images = timed_encode
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    def prompts(chosen: list[bytes]) -> list[dict]:
        return [{"prompt_token_ids": PROMPT_BEFORE + [image_token] + PROMPT_AFTER, "multi_modal_data": {"image": im}}
                for im in chosen]

    llm.generate(prompts([synthetic_jpeg(10**6 + i) for i in range(8)]), params, use_tqdm=False)  # warm-up
    figures = {}
    for name, chosen in (("distinct", images), ("repeated_10", [images[i % 10] for i in range(len(images))])):
        events.clear()
        start = time.perf_counter()
        rows = prompts(chosen)
        prepared = llm.image_prompts().prepare(dict(enumerate(rows)))  # timed alone: what generate does first
        prepare_s = time.perf_counter() - start
        with GpuBusySampler() as busy:
            start = time.perf_counter()
            outputs = llm.generate(rows, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            torch.cuda.synchronize()
        encoder_s = sum(a.elapsed_time(b) for a, b in events) / 1e3
        assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outputs)
        image_tokens = prepared[0].mm.images[0].length
        figures[name] = dict(rows=len(rows), generate_s=seconds, rows_per_s=len(rows) / seconds,
                             output_tok_s=len(rows) * args.max_tokens / seconds, encoder_s=encoder_s,
                             encoder_share=encoder_s / seconds, prepare_s=prepare_s, image_tokens=image_tokens,
                             prefix_cache_hit_rate=llm.stats.prefix_cache_hit_rate, gpu_idle_share=busy.idle_share)
        print(f"batchllm {name:12}: {figures[name]['rows_per_s']:7.2f} rows/s ({seconds:.1f} s; encoder "
              f"{encoder_s:.1f} s = {100 * encoder_s / seconds:.0f} %; host image prep {prepare_s:.1f} s; "
              f"{image_tokens} image tokens per row; GPU idle {100 * busy.idle_share:.1f} %)", flush=True)
    llm.shutdown()
    return figures


def run_hf(images: list[bytes], args) -> dict:
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2_5_VLForConditionalGeneration._from_config(hf_config(args.shape), dtype=torch.bfloat16).eval()
    processor = Qwen2VLImageProcessorPil()
    image_token = SHAPES[args.shape]["image_token_id"]
    rows = images[:args.hf_rows]

    def batch_inputs(chosen: list[bytes]) -> dict:
        processed = processor(images=[Image.open(io.BytesIO(b)) for b in chosen], return_tensors="pt")
        count = int(processed["image_grid_thw"][0].prod()) // 4
        ids = torch.tensor([PROMPT_BEFORE + [image_token] * count + PROMPT_AFTER] * len(chosen), device="cuda")
        # mm_token_type_ids: transformers' 3-D positions need it (without, it falls back to 1-D ones).
        return dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == image_token).int(),
                    pixel_values=processed["pixel_values"].to("cuda", torch.bfloat16),
                    image_grid_thw=processed["image_grid_thw"].to("cuda"))

    kwargs = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False)
    with torch.no_grad():
        model.generate(**batch_inputs(rows[:2]), **kwargs)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for first in range(0, len(rows), args.hf_batch):
            model.generate(**batch_inputs(rows[first:first + args.hf_batch]), **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    print(f"HF generate        : {len(rows) / seconds:7.2f} rows/s ({seconds:.1f} s for {len(rows)} rows, batch "
          f"{args.hf_batch})", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return dict(rows=len(rows), batch=args.hf_batch, generate_s=seconds, rows_per_s=len(rows) / seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[s for s in SHAPES if "vl" in s], default="qwen2.5-vl-7b")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--hf-rows", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for our runs (a probe of GIL waits; Python's default is 0.005 s)")
    parser.add_argument("--out", default=None, help="also copy the JSON record here")
    args = parser.parse_args()
    directory = make_shape_dir(args.shape)
    images = [synthetic_jpeg(i) for i in range(args.rows)]
    # HF first: its plain model gives its memory back when dropped, before the engine sizes its KV pool.
    hf = run_hf(images, args) if args.hf_rows else None
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    ours = run_ours(directory, images, args)
    record = dict(date=datetime.date.today().isoformat(), git_sha=git_sha(), shape=args.shape,
                  workload=dict(rows=args.rows, image=f"{SIDE}x{SIDE} JPEG", max_tokens=args.max_tokens,
                                max_num_seqs=args.max_num_seqs, switch_interval_s=sys.getswitchinterval()),
                  batchllm=ours, hf=hf, hardware=hardware("cuda")[1])
    if hf:
        record["vs_hf"] = ours["distinct"]["rows_per_s"] / hf["rows_per_s"]
        print(f"batchllm / HF rows/s: {record['vs_hf']:.1f}x", flush=True)
    record["repeated_speedup"] = ours["repeated_10"]["rows_per_s"] / ours["distinct"]["rows_per_s"]
    print(f"10 repeated images / distinct: {record['repeated_speedup']:.2f}x", flush=True)
    switch = "" if args.switch_interval is None else f"-switch{args.switch_interval * 1e6:g}us"
    name = (f"{datetime.date.today().isoformat()}-vision-{args.shape}-seqs{args.max_num_seqs}{switch}-"
            f"{hardware('cuda')[0]}")
    save_record(f"{name}.json", record, args.out)


if __name__ == "__main__":
    main()
