"""Several models in one server, each in an engine process of its own: the default model ("alpha", with a LoRA
adapter "ad" beside it) and a tiny random-weight Llama written by transformers ("tiny"). Every answer is compared
with HF transformers' (PEFT's for the adapter) greedy tokens on the model the request named: live requests, the
Batch API's rows (routed by their body's `model`), `/v1/models`, an unknown model's 404, and an engine process that
dies (its requests fail with 503, /health names it, the other model still answers)."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import threading

import httpx
import pytest
import torch

from batchllm.connectors.adapters import adapter_requests
from batchllm.entrypoints.server.app import build_app
from batchllm.entrypoints.server.batch_runner import BatchSettings
from batchllm.entrypoints.server.engine_process import EngineLaunch, launch_engines
from batchllm.entrypoints.server.served_models import ServedModels
from batchllm.model.default_model import default_model_path
from tests.server.conftest import openai_client, serving, wait_until

TEXT = "The capital of France is"  # a batch line's prompt is text
PROMPT = [504, 3575, 282, 4649, 314]  # its tokens
MAX_TOKENS = 4
SLOW = 300.0
SETTINGS = BatchSettings(rows_per_shard=2, flush_seconds=0.2, max_in_flight=2)
ENGINE = dict(device="cpu", max_num_seqs=4, num_kv_blocks=160, max_model_len=2048)


def _hf_greedy(model) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny model's directory, the adapter's, and HF's greedy tokens for each served name."""
    import peft
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.5, tie_word_embeddings=True)  # large weights: clear greedy choices
    tiny = LlamaForCausalLM(config).eval()
    tiny.save_pretrained(root / "tiny")
    for name in os.listdir(default_model_path()):
        if name.startswith(("tokenizer", "chat_template")):
            shutil.copy(default_model_path() / name, root / "tiny" / name)
    base = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    reference = {"alpha": _hf_greedy(base), "tiny": _hf_greedy(tiny)}
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0, task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_" in name:  # both halves random: the adapter changes the answer
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    lora.save_pretrained(root / "ad")
    reference["ad"] = _hf_greedy(lora.eval())
    assert len({tuple(ids) for ids in reference.values()}) == 3, "the three models must answer differently"
    return {"tiny": root / "tiny", "ad": root / "ad", "reference": reference}


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    alpha, tiny = launch_engines([EngineLaunch("alpha", None, {**ENGINE, "enable_lora": True}, num_threads=1),
                                  EngineLaunch("tiny", checkpoints["tiny"], ENGINE, num_threads=1)])
    try:
        adapters = adapter_requests([("ad", str(checkpoints["ad"]))], alpha.llm)
        models = ServedModels([("alpha", alpha, adapters), ("tiny", tiny, {})])
        app = build_app(models, data_dir=tmp_path_factory.mktemp("data"), batch_settings=SETTINGS)
        tokenizer = alpha.llm.tokenizer
        assert tokenizer(TEXT)["input_ids"] == PROMPT
        texts = {name: tokenizer.decode(ids) for name, ids in checkpoints["reference"].items()}
        with serving(app) as url:
            yield {"url": url, "client": openai_client(url), "texts": texts, "engines": {"alpha": alpha,
                                                                                          "tiny": tiny}}
    finally:
        for engine in (alpha, tiny):
            engine.shutdown(0)


def _complete(url: str, model: str | None, **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/completions", json=body, timeout=SLOW)


def test_models_lists_each_model_and_the_adapter(served):
    cards = httpx.get(f"{served['url']}/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("alpha", None), ("tiny", None), ("ad", "alpha")]
    assert httpx.get(f"{served['url']}/v1/models/tiny", timeout=30).json()["id"] == "tiny"


def test_each_request_runs_on_the_model_it_names(served):
    for model in ("alpha", "tiny", "ad", None):
        response = _complete(served["url"], model)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["text"] == served["texts"][model or "alpha"], model
        assert body["model"] == (model or "alpha")


def test_an_unknown_model_is_a_404_naming_the_served_ones(served):
    response = _complete(served["url"], "llama-9000")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    for name in ("llama-9000", "alpha", "tiny", "ad"):
        assert name in error["message"]


def test_batch_rows_run_on_the_model_their_body_names(served):
    client = served["client"]
    names = ["tiny", "alpha", None, "ad", "tiny"]
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": TEXT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                  **({} if name is None else {"model": name})}}) for i, name in enumerate(names)]
    file_id = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), SLOW, "the batch")
    batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == len(names), batch
    answers = {a["custom_id"]: a for a in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    for i, name in enumerate(names):
        assert answers[f"r{i}"]["response"]["body"]["choices"][0]["text"] == served["texts"][name or "alpha"], name

    unknown = lines + [json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions",
                                   "body": {"prompt": "hi", "model": "nope"}})]
    file_id = client.files.create(file=("bad.jsonl", io.BytesIO("\n".join(unknown).encode())), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status in ("completed", "failed"), SLOW, "the batch")
    errors = client.batches.retrieve(batch.id).errors.data
    assert [(e.code, e.line) for e in errors] == [("model_not_found", len(unknown))]


def test_a_job_larger_than_a_tokenizer_chunk_runs_on_an_engine_process(served, tmp_path):
    # A shard of over 128 rows is tokenized on a worker thread, and the job asks the engine whether it may pause.
    from batchllm.connectors.jobs.jsonl_batch import run_jsonl_job

    count = 150
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"{TEXT} {i}", "max_tokens": 1}}) for i in range(count)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines))
    engine = served["engines"]["tiny"].batch_engine()
    result = run_jsonl_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm=engine, rows_per_shard=1000,
                           use_tqdm=False, max_tokens=None)
    assert result.complete
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(answers) == count and all(a["error"] is None for a in answers)


def test_an_engine_process_that_dies_fails_its_requests_and_health_names_it(served):
    url, tiny = served["url"], served["engines"]["tiny"]
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(r=_complete(url, "tiny", max_tokens=2000,
                                                                         ignore_eos=True)))
    thread.start()
    wait_until(lambda: tiny.snapshot.num_running == 1, 60, "the long request to run")
    os.kill(tiny.pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert outcome["r"].status_code == 503 and "engine" in outcome["r"].json()["error"]["message"]
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 503 and "tiny" in health.json()["error"]["message"]
    assert _complete(url, "tiny").status_code == 503
    alive = _complete(url, "alpha")
    assert alive.status_code == 200 and alive.json()["choices"][0]["text"] == served["texts"]["alpha"]
