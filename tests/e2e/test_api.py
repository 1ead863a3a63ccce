"""The public API on the real default model: stop rules, logprobs, n, chat, per-request errors.

References are independent of batchllm: HF transformers' greedy continuation and scores, the tokenizer,
or values derived by hand from them.
"""

from __future__ import annotations

import math

import pytest
import torch

from batchllm import LLM, SamplingParams

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def llm(async_scheduling):
    return LLM(max_model_len=512, async_scheduling=async_scheduling)


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_continuation(tokenizer, hf_model):
    """HF greedy continuation of PROMPT (40 tokens, EOS ignored) and the raw logits at each step."""
    ids = torch.tensor([tokenizer(PROMPT)["input_ids"]])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, min_new_tokens=40,
                                do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), [step[0].float() for step in out.logits]


def _one(llm, params, prompt=PROMPT):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_max_tokens_and_ignore_eos(llm, hf_continuation):
    tokens, _ = hf_continuation
    out = _one(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert out.token_ids == tokens and out.finish_reason == "length"
    assert out.text == llm.tokenizer.decode(tokens, skip_special_tokens=True)


def test_stop_token_ids(llm, hf_continuation):
    tokens, _ = hf_continuation
    stop_id = tokens[6]
    out = _one(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop_id]))
    first = tokens.index(stop_id)
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_stop_string_truncates_text(llm, hf_continuation):
    tokens, _ = hf_continuation
    full = llm.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = full[12:15]  # a stop string that occurs in the reference text, likely mid-token
    out = _one(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "@@never@@"]))
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    with_stop = _one(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                                         include_stop_str_in_output=True))
    assert with_stop.text == full[: full.index(stop) + len(stop)]


def test_eos_and_min_tokens(llm):
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=False,
                                               add_generation_prompt=True)
    eos = llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    short = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == eos
    n = len(short.token_ids)
    longer = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 3),
                          use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 3
    assert eos not in longer.token_ids[: n + 3 - 1]
    assert longer.token_ids[: n - 1] == short.token_ids[: n - 1]


def test_logprobs_match_hf_scores(llm, hf_continuation):
    tokens, logits = hf_continuation
    out = _one(llm, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3))
    assert out.token_ids == tokens[:10]
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = torch.log_softmax(logits[step], dim=-1)
        top = torch.topk(ref, 3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for tid, lp in entry.items():
            assert math.isclose(lp.logprob, ref[tid].item(), abs_tol=1e-3)
        assert entry[token].rank == 1  # greedy picks the most likely token
        total += ref[token].item()
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-2)


def test_n_samples_equal_separate_seeded_requests(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    together = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert [c.index for c in together.outputs] == [0, 1, 2]
    for j, completion in enumerate(together.outputs):
        alone = _one(llm, SamplingParams(temperature=1.0, seed=7 + j, max_tokens=12))
        assert completion.token_ids == alone.token_ids
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1


def test_chat_uses_the_models_template(llm):
    conversation = [{"role": "user", "content": "What is 2 + 2?"}]
    via_chat = llm.chat([conversation], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    ids = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    assert via_chat.prompt_token_ids == list(ids)
    via_ids = llm.generate([list(ids)], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert via_chat.outputs[0].token_ids == via_ids.outputs[0].token_ids


def test_bad_request_fails_alone_in_input_order(llm):
    too_long = list(range(100, 100 + 600))  # max_model_len is 512
    outs = llm.generate(["Hello", too_long, "World"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello", None, "World"]
    assert outs[1].error and "max_model_len" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert all(o.error is None and len(o.outputs[0].token_ids) == 4 for o in (outs[0], outs[2]))


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -3), ("min_p", 2.0),
                                         ("max_tokens", 0), ("n", 0), ("logprobs", 100), ("stop", [""]),
                                         ("repetition_penalty", 0.0), ("presence_penalty", 5.0)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_invalid_llm_arguments_fail_fast():
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=10)
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="int7")
    with pytest.raises((ValueError, FileNotFoundError), match="does-not-exist"):
        LLM(model="/does-not-exist")


def test_repetition_penalty_matches_hf(llm, hf_model):
    ids = llm.tokenizer("one two one two one two")["input_ids"]
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=20, min_new_tokens=20, do_sample=False, repetition_penalty=1.3)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                             repetition_penalty=1.3), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[0, len(ids):].tolist()


def test_request_metrics_are_ordered_timestamps(llm):
    out = _one(llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    m = out.metrics
    assert m.arrival_time <= m.first_token_time <= m.finished_time
    assert m.time_to_first_token > 0
    expected = (m.finished_time - m.first_token_time) / 5
    assert m.time_per_output_token(len(out.token_ids)) == pytest.approx(expected)
    assert m.time_per_output_token(1) is None


def test_prefix_aware_admission_order(llm):
    rows = [[5, 9, 1], [2, 7], [5, 9, 0], [2, 7, 7]]
    assert llm.admission_order(rows) == [1, 3, 2, 0]  # shared prefixes [2, 7] and [5, 9] become adjacent
    llm.reorder_by_prefix = False
    try:
        assert llm.admission_order(rows) == [0, 1, 2, 3]
    finally:
        llm.reorder_by_prefix = True


def test_vllm_prompt_dicts_without_images_work_on_a_text_model(llm, tokenizer, hf_continuation):
    """vLLM's `{"prompt": text}` and `{"prompt_token_ids": ids}` (TextPrompt, TokensPrompt) are plain prompts on a
    model without a vision tower, through `generate` and `stream`; images for it, or a key no prompt dict has, are
    a ValueError naming the row."""
    tokens, _ = hf_continuation
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ids = tokenizer(PROMPT)["input_ids"]
    outputs = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": ids}, {"prompt": ids}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [tokens[:8]] * 3
    assert outputs[0].prompt == PROMPT and outputs[1].prompt_token_ids == ids
    streamed = dict(llm.stream([("a", {"prompt": PROMPT}, params), ("b", {"prompt_token_ids": ids}, params)]))
    assert [streamed[key].outputs[0].token_ids for key in "ab"] == [tokens[:8]] * 2
    with pytest.raises(ValueError, match="prompt 1 has images, but LlamaForCausalLM takes text only"):
        llm.generate([PROMPT, {"prompt": PROMPT, "multi_modal_data": {"image": b"x"}}], params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: unknown key 'text'"):
        llm.generate([{"text": PROMPT}], params, use_tqdm=False)


def test_get_tokenizer_is_the_models_tokenizer(llm, tokenizer):
    """vLLM's `LLM.get_tokenizer()`: the HF tokenizer of the model directory, encoding as transformers' own does."""
    assert llm.get_tokenizer() is llm.tokenizer
    assert llm.get_tokenizer()(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]
    assert llm.get_tokenizer().chat_template == tokenizer.chat_template
