"""Images through the jobs on the tiny Qwen2.5-VL checkpoint: `batchllm run images.parquet out/ --image-column img
--prompt "Describe the image."` killed (SIGKILL) and resumed, every row exactly once and equal to HF greedy; a
Parquet `{bytes, path}` struct column as HF datasets writes an `Image` feature; a CSV of paths whose changed image
refuses the resume; an OpenAI batch file with image_url parts. A bad image fails its row in each."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchllm
from batchllm.connectors.jobs.manifest import ManifestMismatch
from tests.connectors.jobs import read_shards
from tests.e2e.qwen2_5_vl_checkpoint import png_bytes, random_image
from tests.e2e.test_qwen2_5_vl import MAX_NEW, PAD, chat, checkpoint, hf  # noqa: F401  (fixtures)

CAPTION = "Describe the image."
ROWS, BAD = 16, 5
ENGINE = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 256}
JOB = {"image_column": "img", "prompt_template": CAPTION, "rows_per_shard": 2, "max_in_flight": 2,
       "max_tokens": MAX_NEW, "temperature": 0.0, "use_tqdm": False}


# They name the image model (`model=`), which replaces the engine cache's entry: put the default model's back after.
pytestmark = pytest.mark.usefixtures("keep_the_engine_cache")


@pytest.fixture(scope="module")
def pictures():
    return [random_image(30 + i, 64 + 12 * (i % 3), 64 + 16 * (i % 2)) for i in range(ROWS)]


@pytest.fixture(scope="module")
def captions(hf, checkpoint, pictures):  # noqa: F811
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint[0]))
    return [tokenizer.decode(hf(chat(PAD + CAPTION), [p]), skip_special_tokens=True) for p in pictures]


def _check_rows(shards: pa.Table, captions: list[str], bad: set[int]) -> None:
    shards = shards.sort_by("id")
    assert shards.column("id").to_pylist() == list(range(len(captions)))  # every row, once
    for row, (text, error) in enumerate(zip(shards.column("generated_text").to_pylist(),
                                            shards.column("error").to_pylist())):
        if row in bad:
            assert text is None and isinstance(error, str)
        else:
            assert (text, error) == (captions[row], None)


def _records(output: Path) -> int:
    manifest = output / "_manifest.jsonl"
    return max(0, len(manifest.read_bytes().split(b"\n")) - 2) if manifest.exists() else 0


def test_cli_parquet_job_killed_and_resumed(checkpoint, pictures, captions, tmp_path):  # noqa: F811
    images = [png_bytes(p) for p in pictures]
    images[BAD] = b"\x89PNG truncated"
    pq.write_table(pa.table({"id": list(range(ROWS)), "img": images}), tmp_path / "images.parquet",
                   row_group_size=4)
    output, log = tmp_path / "out", tmp_path / "job.log"
    command = [sys.executable, "-m", "batchllm", "run", str(tmp_path / "images.parquet"), str(output),
               "--image-column", "img", "--prompt", CAPTION, "--model", str(checkpoint[0]), "--device", "cpu",
               "--dtype", "float32", "--num-kv-blocks", "256", "--max-tokens", str(MAX_NEW), "--rows-per-shard", "2",
               "--max-in-flight", "2", "--no-progress"]
    # Not from the repo root: `python -m` puts the cwd on sys.path, and the root's kernels/ shadows HF's `kernels`.
    process = subprocess.Popen(command, cwd=tmp_path, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while _records(output) < 1 and process.poll() is None:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    assert process.poll() is None, f"the job ended before the kill: {log.read_text()}"
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert 1 <= _records(output) < ROWS // 2
    assert subprocess.run(command, cwd=tmp_path, stdout=log.open("ab"), stderr=subprocess.STDOUT).returncode == 0
    assert "already done" in log.read_text().splitlines()[-1]
    _check_rows(read_shards(output), captions, {BAD})
    fingerprint = json.loads((output / "_manifest.jsonl").read_text().splitlines()[0])
    assert fingerprint["fingerprint"]["images"]["images"] == ROWS


def test_parquet_image_struct_as_hf_datasets_writes_it(checkpoint, pictures, captions, tmp_path):  # noqa: F811
    rows = 4
    paths = []
    for i in range(rows):
        paths.append(str(tmp_path / f"{i}.png"))
        pictures[i].save(paths[-1])
    dataset = datasets.Dataset.from_dict({"id": list(range(rows)), "img": paths}).cast_column("img", datasets.Image())
    dataset.to_parquet(tmp_path / "in.parquet")
    assert pa.types.is_struct(pq.read_schema(tmp_path / "in.parquet").field("img").type)
    result = batchllm.run_job(tmp_path / "in.parquet", tmp_path / "out", model=checkpoint[0], engine_kwargs=ENGINE,
                              **JOB)
    assert result.complete and result.error_rows == 0
    _check_rows(read_shards(tmp_path / "out"), captions[:rows], set())


def test_csv_of_paths_pins_the_images(checkpoint, pictures, captions, tmp_path):  # noqa: F811
    rows = 4
    lines = ["id,img"]
    for i in range(rows):
        pictures[i].save(tmp_path / f"{i}.png")
        lines.append(f"{i},{tmp_path / f'{i}.png'}")
    lines[-1] = f"{rows - 1},{tmp_path / 'missing.png'}"
    (tmp_path / "in.csv").write_text("\n".join(lines) + "\n")
    output = tmp_path / "out"
    result = batchllm.run_job(tmp_path / "in.csv", output, model=checkpoint[0], engine_kwargs=ENGINE, **JOB)
    assert result.complete and result.error_rows == 1
    _check_rows(read_shards(output), captions[:rows], {rows - 1})
    pictures[5].save(tmp_path / "1.png")  # the same path, another picture: not the same row any more
    with pytest.raises(ManifestMismatch, match="images.sha256"):
        batchllm.run_job(tmp_path / "in.csv", output, model=checkpoint[0], engine_kwargs=ENGINE, **JOB)


def test_openai_batch_with_image_url_parts(checkpoint, pictures, captions, tmp_path):  # noqa: F811
    def request(i: int, url: str) -> str:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": CAPTION}]
        body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_NEW,
                "temperature": 0}
        return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})

    urls = ["data:image/png;base64," + base64.b64encode(png_bytes(p)).decode() for p in pictures[:2]]
    urls.append("data:image/png;base64," + base64.b64encode(b"not a png").decode())
    (tmp_path / "batch.jsonl").write_text("\n".join(request(i, url) for i, url in enumerate(urls)) + "\n")
    batchllm.run_job(tmp_path / "batch.jsonl", tmp_path / "out.jsonl", model=checkpoint[0], engine_kwargs=ENGINE,
                     use_tqdm=False)
    answers = {line["custom_id"]: line for line in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    for i in range(2):
        assert answers[f"r{i}"]["response"]["body"]["choices"][0]["message"]["content"] == captions[i]
    assert answers["r2"]["response"] is None and "not a PNG/JPEG" in answers["r2"]["error"]["message"]
