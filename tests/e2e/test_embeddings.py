"""Pooling tasks (`LLM(task="embed" | "classify" | "score")`) against HF transformers.

Embeddings of the real default model must equal HF `AutoModel`'s final hidden states pooled the same way (float32,
one prompt at a time, within 1e-5), for rows of very different lengths batched together, chunked under a tiny token
budget, on a pool that holds one prompt at a time, and with prefix-cache hits. (A pooling request never grows
past its prompt, so nothing preempts it: the scheduler admits a chunk only into free blocks.) A random-weight
`LlamaForSequenceClassification` checkpoint's logits must equal HF `AutoModelForSequenceClassification`'s.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from batchllm import LLM

TEXTS = ["hi", "The capital of France is Paris.",
         "A much longer sentence about rivers, stones and the quiet sea, " * 9,
         "Write a short poem about lighthouses and the keepers who tend them through the winter storms."]


def _hf_pooled(model, token_lists, pooling: str, normalize: bool) -> np.ndarray:
    rows = []
    with torch.inference_mode():
        for ids in token_lists:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            vector = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[pooling]
            rows.append(torch.nn.functional.normalize(vector, dim=-1) if normalize else vector)
    return torch.stack(rows).numpy()


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.mark.parametrize("pooling,normalize,options", [
    ("mean", False, {"max_num_batched_tokens": 16}),  # every prompt but the shortest in chunks
    ("last", True, {}),
    ("cls", False, {"max_num_batched_tokens": 24}),
    # 6 blocks for 4 rows of up to 96 tokens (the longest truncated to the pool), on the asynchronous loop.
    ("mean", True, {"num_kv_blocks": 6, "max_num_batched_tokens": 32, "async_scheduling": True}),
], ids=["mean-chunked", "last-normalized", "cls-chunked", "mean-tight-pool-async"])
def test_embeddings_equal_hf(hf_model, tokenizer, pooling, normalize, options):
    llm = LLM(device="cpu", task="embed", pooling=pooling, normalize=normalize, **options)
    outs = llm.embed(TEXTS, use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outs], dtype=np.float32)
    token_lists = [tokenizer(t)["input_ids"][: llm.max_model_len] for t in TEXTS]  # a 6-block pool truncates one
    assert [o.prompt_token_ids for o in outs] == token_lists
    expected = _hf_pooled(hf_model, token_lists, pooling, normalize)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    stats = llm.stats
    assert stats.num_decode_tokens == 0 and stats.num_generated_tokens == 0
    assert stats.num_prefill_tokens == sum(len(o.prompt_token_ids) for o in outs)
    kv = llm.engine.scheduler.kv_cache
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_last_token_pooling_reuses_cached_prefixes(hf_model, tokenizer, tiny_llama_dir):
    shared = "You are an assistant that answers questions about geography, briefly and exactly. " * 3
    texts = [shared + q for q in ("Where is Lyon?", "What is the longest river?", "Name a desert.")]
    llm = LLM(device="cpu", task="embed", pooling="last")
    outs = llm.embed(texts, use_tqdm=False)
    assert llm.stats.prefix_cache_hits > 0
    expected = _hf_pooled(hf_model, [tokenizer(t)["input_ids"] for t in texts], "last", True)
    np.testing.assert_allclose(np.array([o.outputs.embedding for o in outs]), expected, atol=1e-5, rtol=1e-5)
    # Mean pooling reads every token's state: it takes no cache hits (bookkeeping only: the session's tiny Llama,
    # which has the default model's tokenizer, so the same prompts and blocks).
    mean = LLM(tiny_llama_dir, device="cpu", task="embed", pooling="mean", normalize=False)
    mean.embed(texts, use_tqdm=False)
    assert mean.stats.prefix_cache_hits == 0


def test_templates_truncation_and_errors(tokenizer):
    llm = LLM(device="cpu", task="embed", max_model_len=32)
    long_ids = list(range(200, 260))
    right, left = (llm.embed([long_ids], truncate=side, use_tqdm=False)[0] for side in ("right", "left"))
    assert right.prompt_token_ids == long_ids[:32] and left.prompt_token_ids == long_ids[-32:]
    failed = llm.embed([long_ids, [5, 6, 7]], truncate=None, use_tqdm=False)
    assert failed[0].outputs is None and "60 tokens but max_model_len is 32" in failed[0].error
    assert failed[1].error is None and len(failed[1].outputs.embedding) == 576
    templated = llm.embed(["Lyon"], prompt_template="query: {text}", use_tqdm=False)[0]
    assert templated.prompt == "query: Lyon" and templated.prompt_token_ids == tokenizer("query: Lyon")["input_ids"]
    matrix, errors = llm.embed_matrix(["a", "b c"])
    assert matrix.shape == (2, 576) and matrix.dtype == np.float32 and errors == [None, None]
    with pytest.raises(ValueError, match="prompt_template must contain"):
        llm.embed(["x"], prompt_template="query:")
    with pytest.raises(ValueError, match="does not generate; call embed"):
        llm.generate(["x"], use_tqdm=False)
    with pytest.raises(ValueError, match=r"LLM.classify\(\) needs an LLM built with task='classify'"):
        llm.classify(["x"])
    with pytest.raises(ValueError, match="LLM argument pooling must be None or one of"):
        LLM(device="cpu", task="embed", pooling="max")
    with pytest.raises(ValueError, match="LLM argument task must be one of"):
        LLM(device="cpu", task="rerank")


def test_embedding_cosine_scores(hf_model, tokenizer):
    llm = LLM(device="cpu", task="embed", pooling="mean")
    query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow."]
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    vectors = _hf_pooled(hf_model, [tokenizer(t)["input_ids"] for t in [query, *docs]], "mean", True)
    np.testing.assert_allclose(scores, vectors[1:] @ vectors[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="got 2 and 3 texts"):
        llm.score(["a", "b"], ["c", "d", "e"])


def test_the_sentence_transformers_layout_sets_pooling(model_path, tmp_path, hf_model, tokenizer):
    directory = tmp_path / "st"
    shutil.copytree(model_path, directory)
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    llm = LLM(directory, device="cpu", task="embed")
    assert llm.pooling_params.pooling == "mean" and not llm.pooling_params.normalize  # no Normalize module
    got = np.array(llm.embed(TEXTS[:2], use_tqdm=False)[0].outputs.embedding)
    np.testing.assert_allclose(got, _hf_pooled(hf_model, [tokenizer(TEXTS[0])["input_ids"]], "mean", False)[0],
                               atol=1e-5, rtol=1e-5)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling 'pooling_mode_max_tokens' is not supported"):
        LLM(directory, device="cpu", task="embed")


# ---- classification: a random-weight LlamaForSequenceClassification ---------------------------------------------

@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    directory = tmp_path_factory.mktemp("classifier")
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256, num_labels=3)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.save_pretrained(directory)
    return directory, model


def test_classification_logits_equal_hf(classifier):
    directory, hf = classifier
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (1, 7, 40, 90)]
    llm = LLM(directory, device="cpu", task="classify", skip_tokenizer_init=True, max_num_batched_tokens=32)
    outs = llm.classify(prompts, use_tqdm=False)
    with torch.inference_mode():
        expected = np.stack([hf(torch.tensor([p])).logits[0].numpy() for p in prompts])
    np.testing.assert_allclose(np.stack([o.outputs.logits for o in outs]), expected, atol=1e-5, rtol=1e-5)
    probs = np.array(outs[0].outputs.probs)
    np.testing.assert_allclose(probs, torch.softmax(torch.tensor(expected[0]), -1).numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="sequence-classification model .* cannot generate"):
        LLM(directory, device="cpu", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="task='score' needs a cross-encoder with one label; .* has 3"):
        LLM(directory, device="cpu", task="score", skip_tokenizer_init=True)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_model_parallel_engines_embed_like_one_process(tmp_path, parallel):
    from tests.distributed.test_tensor_parallel import SHAPES, prompts, write_checkpoint

    model = write_checkpoint(tmp_path, **SHAPES["gqa-biases"])
    options = dict(device="cpu", task="embed", pooling="mean", skip_tokenizer_init=True, max_num_batched_tokens=16)
    expected = LLM(model, **options).embed_matrix(prompts(1001))[0]
    llm = LLM(model, **options, **parallel)
    try:
        np.testing.assert_allclose(llm.embed_matrix(prompts(1001))[0], expected, atol=1e-5, rtol=1e-5)
    finally:
        llm.shutdown()


def test_a_one_label_cross_encoder_scores_pairs(model_path, tmp_path):
    """task="score" on a one-label classifier: each pair, encoded as the tokenizer encodes text pairs, through the
    head; the score is the sigmoid of HF's logit for the same ids."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256, num_labels=1)
    torch.manual_seed(1)
    hf = LlamaForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    llm = LLM(tmp_path, device="cpu", task="score")
    query, docs = "Where is Paris?", ["Paris is in France.", "Bananas are yellow."]
    scores = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    with torch.inference_mode():
        logits = [hf(torch.tensor([tokenizer(query, doc)["input_ids"]])).logits[0, 0] for doc in docs]
    np.testing.assert_allclose(scores, torch.sigmoid(torch.stack(logits)).numpy(), atol=1e-6)
    with pytest.raises(ValueError, match=r"LLM.embed\(\) needs an embedding model; this one is a cross-encoder"):
        llm.embed(["x"])


# ---- CUDA: pooling on the device, vectors copied behind the step (executor/step_output.py) ----------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_pooling_on_cuda_equals_hf(classifier, async_scheduling):
    """The random classifier's backbone as an embedding model (mean, last) and its head (classify), float32 on the
    GPU, chunked under a small budget and at the default one, against HF's AutoModel on the same GPU."""
    import copy

    from transformers import AutoModel

    directory, hf_classifier = classifier
    hf_classifier = copy.deepcopy(hf_classifier).cuda()  # the fixture's model stays on the CPU for the CPU test
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (1, 7, 40, 90, 200, 13)]
    backbone = AutoModel.from_pretrained(directory, dtype=torch.float32).cuda().eval()
    with torch.inference_mode():
        hidden = [backbone(torch.tensor([p], device="cuda")).last_hidden_state[0] for p in prompts]
        logits = np.stack([hf_classifier(torch.tensor([p], device="cuda")).logits[0].cpu().numpy()
                           for p in prompts])
    for pooling, budget in (("mean", 32), ("last", None)):
        llm = LLM(directory, device="cuda", dtype="float32", task="embed", pooling=pooling, normalize=False,
                  skip_tokenizer_init=True, async_scheduling=async_scheduling, max_num_batched_tokens=budget)
        matrix, errors = llm.embed_matrix(prompts)
        expected = np.stack([(h.mean(0) if pooling == "mean" else h[-1]).cpu().numpy() for h in hidden])
        assert errors == [None] * len(prompts)
        np.testing.assert_allclose(matrix, expected, atol=1e-4, rtol=1e-4)
        del llm
    llm = LLM(directory, device="cuda", dtype="float32", task="classify", skip_tokenizer_init=True,
              async_scheduling=async_scheduling, max_num_batched_tokens=48)
    outs = llm.classify(prompts, use_tqdm=False)
    np.testing.assert_allclose(np.stack([o.outputs.logits for o in outs]), logits, atol=1e-4, rtol=1e-4)
