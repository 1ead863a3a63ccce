"""EAGLE and EAGLE-3 heads with random weights in the authors' layouts (SafeAILab/EAGLE), on a tiny random
8-layer Llama (EAGLE-3 fuses three distinct layers of it; the heads' bookkeeping, not the real weights, is the
point, and HF loads the same checkpoint): greedy outputs equal HF transformers' under preemption and a tiny
token budget, and every draft the engine proposes equals the draft of an independent reference: the head's
equations written out in torch over the whole sequence, on HF transformers' hidden states, without paging,
chunking or the one-behind KV scheme."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from batchllm import LLM, SamplingParams
from batchllm.executor.model_runner import ModelRunner
from tests.e2e.graph_replay import EagerReplay
from tests.e2e.test_spec_decode import MAX_NEW, _greedy, _tight, spec_prompts
from tests.hf_greedy import hf_greedy_tokens
from tests.tiny_models import TINY_LLAMA, write_tiny_llama

NUM_DRAFTS = 3
CHECKED_PROPOSALS = 40
DRAFTED_NEW = 16  # tokens per row in the draft comparison: ~150 proposals to sample 40 from (the greedy test runs 24)
SHORT_PROMPT = 200  # tokens
DRAFT_VOCAB = 4096


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The target of every engine and reference here (overrides e2e/conftest.py's default model)."""
    return write_tiny_llama(tmp_path_factory.mktemp("target"), **{**TINY_LLAMA, "num_hidden_layers": 8})


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return spec_prompts(tokenizer)


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_greedy(model_path, prompts):
    return hf_greedy_tokens(model_path, prompts, MAX_NEW)


def _layer_tensors(prefix: str, c: dict, attn_in: int, generator: torch.Generator) -> dict:
    h, hd, heads, kv, inter = (c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"],
                               c["intermediate_size"])

    def rand(*shape, std=0.05):
        return torch.randn(*shape, generator=generator) * std

    return {f"{prefix}.self_attn.q_proj.weight": rand(heads * hd, attn_in),
            f"{prefix}.self_attn.k_proj.weight": rand(kv * hd, attn_in),
            f"{prefix}.self_attn.v_proj.weight": rand(kv * hd, attn_in, std=0.2),
            f"{prefix}.self_attn.o_proj.weight": rand(h, heads * hd, std=0.2),
            f"{prefix}.mlp.gate_proj.weight": rand(inter, h), f"{prefix}.mlp.up_proj.weight": rand(inter, h),
            f"{prefix}.mlp.down_proj.weight": rand(h, inter),
            f"{prefix}.post_attention_layernorm.weight": 1 + rand(h, std=0.1)}


@pytest.fixture(scope="module")
def eagle_heads(tmp_path_factory, model_path):
    """{"eagle": dir, "eagle3": dir}, each a config.json and model.safetensors with the authors' tensor names."""
    config = json.loads((model_path / "config.json").read_text())
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    h, vocab = config["hidden_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(7)
    paths = {}
    eagle = tmp_path_factory.mktemp("eagle")
    (eagle / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    tensors = _layer_tensors("layers.0", config, h, generator)
    tensors |= {"fc.weight": torch.randn(h, 2 * h, generator=generator) * 0.05, "fc.bias": torch.zeros(h)}
    save_file(tensors, str(eagle / "model.safetensors"))
    paths["eagle"] = eagle
    eagle3 = tmp_path_factory.mktemp("eagle3")
    (eagle3 / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1,
                                                    "architectures": ["LlamaForCausalLMEagle3"],
                                                    "draft_vocab_size": DRAFT_VOCAB}))
    tensors = _layer_tensors("midlayer", config, 2 * h, generator)
    target_ids = torch.randperm(vocab, generator=generator)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    tensors |= {"fc.weight": torch.randn(h, 3 * h, generator=generator) * 0.05,
                "midlayer.input_layernorm.weight": torch.ones(h), "midlayer.hidden_norm.weight": torch.ones(h),
                "norm.weight": torch.ones(h), "lm_head.weight": torch.randn(DRAFT_VOCAB, h, generator=generator),
                "d2t": target_ids - torch.arange(DRAFT_VOCAB), "t2d": t2d}
    save_file(tensors, str(eagle3 / "model.safetensors"))
    paths["eagle3"] = eagle3
    return paths


def _spec(method: str, path) -> dict:
    return {"method": method, "model": str(path), "num_speculative_tokens": NUM_DRAFTS, "adaptive": False}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_greedy_equals_hf_under_preemption(method, model_path, eagle_heads, prompts, hf_greedy):
    llm = LLM(speculative_config=_spec(method, eagle_heads[method]), **_tight(prompts, model_path))
    assert _greedy(llm, prompts) == hf_greedy
    stats = llm.stats
    assert stats.num_preemptions >= 1 and stats.num_chunked_prefills >= 1, stats
    assert stats.num_draft_tokens > 100, stats
    assert stats.num_generated_tokens == sum(map(len, hf_greedy))


# ---------------------------------------------------------------------------------------------------------
# The reference: EAGLE's equations (cnets1.py / cnets.py), over a whole sequence with a causal mask.

def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class _ReferenceHead:
    def __init__(self, method: str, path, hf_model) -> None:
        from safetensors.torch import load_file

        self.method, self.w = method, load_file(str(path / "model.safetensors"))
        self.config = hf_model.config
        self.prefix = "midlayer" if method == "eagle3" else "layers.0"
        self.embed = hf_model.model.embed_tokens.weight
        self.rotary = LlamaRotaryEmbedding(hf_model.config)

    def _layer(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        c, w, p = self.config, self.w, self.prefix
        n, hd = len(x), c.head_dim
        q = (x @ w[f"{p}.self_attn.q_proj.weight"].T).view(n, -1, hd).transpose(0, 1)
        k = (x @ w[f"{p}.self_attn.k_proj.weight"].T).view(n, -1, hd).transpose(0, 1)
        v = (x @ w[f"{p}.self_attn.v_proj.weight"].T).view(n, -1, hd).transpose(0, 1)
        cos, sin = self.rotary(v, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        groups = q.shape[1] // k.shape[1]
        k, v = k[0].repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        scores = (q[0] @ k.transpose(1, 2)) / math.sqrt(hd)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, -1) @ w[f"{p}.self_attn.o_proj.weight"].T
        hidden = residual + attn
        normed = _rms(hidden, w[f"{p}.post_attention_layernorm.weight"], c.rms_norm_eps)
        gate, up = normed @ w[f"{p}.mlp.gate_proj.weight"].T, normed @ w[f"{p}.mlp.up_proj.weight"].T
        return hidden + (torch.nn.functional.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T

    def outputs(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """The head's output at every entry; entry p reads `tokens[p]` (the token at p + 1) and `features[p]`."""
        emb, eps = self.embed[torch.tensor(tokens)], self.config.rms_norm_eps
        if self.method == "eagle3":
            x = torch.cat([_rms(emb, self.w["midlayer.input_layernorm.weight"], eps),
                           _rms(features, self.w["midlayer.hidden_norm.weight"], eps)], -1)
            return self._layer(x, features)
        x = torch.cat([emb, features], -1) @ self.w["fc.weight"].T + self.w["fc.bias"]
        return self._layer(x, x)

    def token(self, output: torch.Tensor) -> int:
        if self.method == "eagle3":
            normed = _rms(output, self.w["norm.weight"], self.config.rms_norm_eps)
            d = int((normed @ self.w["lm_head.weight"].T).argmax())
            return d + int(self.w["d2t"][d])
        return int((output @ self.embed.T).argmax())

    def drafts(self, sequence: list[int], target_features: torch.Tensor, k: int) -> list[int]:
        """Drafts after `sequence` (its last token just sampled): entries 0..q-1 from the target, then k greedy
        steps, each fed the previous entry's output as its feature."""
        tokens, features = list(sequence[1:]), target_features[:len(sequence) - 1]
        drafts = []
        for _ in range(k):
            last = self.outputs(tokens, features)[-1]
            drafts.append(self.token(last))
            tokens, features = tokens + [drafts[-1]], torch.cat([features, last[None]])
        return drafts


def _target_features(hf_model, method: str, sequence: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = hf_model.model(torch.tensor([sequence]), output_hidden_states=True)
    if method == "eagle":
        return out.last_hidden_state[0]
    layers = hf_model.config.num_hidden_layers  # EAGLE-3 fuses the stream entering layers 2, L/2 and L-3
    return torch.cat([out.hidden_states[i][0] for i in sorted({2, layers // 2, layers - 3})], -1)


@pytest.mark.parametrize("method,layout", [("eagle", "packed"), ("eagle3", "packed"), ("eagle3", "graph")])
def test_eagle_drafts_equal_the_reference(method, layout, model_path, eagle_heads, prompts, hf_model, hf_greedy,
                                          monkeypatch):
    """`layout="graph"`: verification steps laid out as the CUDA graphs replay them (`graph_replay.py`)."""
    records = []
    original = ModelRunner._propose

    def spy(self, rows, sampled):
        proposals = original(self, rows, sampled)
        accepted = [0] * len(rows.states) if sampled.num_accepted is None else sampled.num_accepted.tolist()
        for r in rows.lookahead.sampled_rows:
            request_id = rows.states[r][0]  # the engine's id of sample 0 of the row: "<request id>.0"
            records.append((request_id.rsplit(".", 1)[0], rows.positions[r] + accepted[r], proposals[request_id]))
        return proposals

    monkeypatch.setattr(ModelRunner, "_propose", spy)
    # Chunked prefill of several rows at once, no preemption: every entry the head reads was written.
    llm = LLM(str(model_path), device="cpu", speculative_config=_spec(method, eagle_heads[method]),
              max_num_batched_tokens=32, enable_prefix_caching=False)
    if layout == "graph":
        llm.runner.graphs = EagerReplay(llm.runner)
    # The short prompts only (309 of 642 tokens): the 333-token one's prefill steps and O(n^2) reference drafts would
    # cost most of the time; the greedy test above runs it.
    short = [i for i, p in enumerate(prompts) if len(p) < SHORT_PROMPT]
    prompts, hf_greedy = [prompts[i] for i in short], [hf_greedy[i][:DRAFTED_NEW] for i in short]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=DRAFTED_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy
    sequences = {o.request_id: list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)}
    reference = _ReferenceHead(method, eagle_heads[method], hf_model)
    fc = None if method == "eagle" else reference.w["fc.weight"].T
    features = {}
    for request_id, sequence in sequences.items():
        target = _target_features(hf_model, method, sequence)
        features[request_id] = target if fc is None else target @ fc
    assert len(records) > 50
    if layout == "graph":
        assert any(query_len > 1 for _, query_len in llm.runner.graphs.replayed)
    # Each reference draft reruns the head over the whole sequence: checking evenly spaced proposals (every row,
    # early and late positions) keeps the test's cost in the engine run.
    checked = records[::max(1, len(records) // CHECKED_PROPOSALS)]
    matches = 0
    for request_id, last_position, drafts in checked:
        sequence = sequences[request_id][:last_position + 1]
        expected = reference.drafts(sequence, features[request_id], len(drafts))
        matches += drafts == expected
    assert matches >= 0.95 * len(checked), f"{matches} of {len(checked)} proposals match the reference"
