"""Rotary position embedding (neox style: the rotated dimensions are split in two halves), as in HF Llama and Phi-3."""

from __future__ import annotations

import math

import torch
from torch import nn

from batchllm import kernels
from batchllm.model.config import RopeScaling


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token's position, from a cos/sin table precomputed for every position.

    The table is built in float32 exactly the way HF builds its per-step cos/sin (same inverse frequencies,
    same `position * inv_freq` product, same LongRoPE attention factor), so indexing it gives bit-identical values.

    `rotary_dim` (< head_dim: Phi-4-mini's `partial_rotary_factor`) rotates only the leading `rotary_dim`
    dimensions of each head and leaves the rest as they are; the kernels see that part as a strided view.
    """

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: RopeScaling | None = None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.is_partial = rotary_dim < head_dim
        inv_freq, attention_factor = _inverse_frequencies(rotary_dim, base, scaling, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # Not persistent: derived from the config, never loaded from a checkpoint.
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)  # [max_positions, dim // 2]
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate `query [T, Hq, D]` and `key [T, Hkv, D]` by `positions [T]`, in place; returns them."""
        if self.is_partial:
            kernels.apply_rotary(positions, query[..., :self.rotary_dim], key[..., :self.rotary_dim],
                                 self.cos, self.sin)
            return query, key
        return kernels.apply_rotary(positions, query, key, self.cos, self.sin)


def _inverse_frequencies(dim: int, base: float, scaling: RopeScaling | None,
                         max_positions: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of the `dim` rotated dimensions, and the factor on cos/sin (1 but for LongRoPE, YaRN)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponents)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "longrope":
        return _longrope(dim, base, exponents, scaling, max_positions)
    if scaling.rope_type == "yarn":
        return _yarn(dim, base, base**exponents, scaling)
    return _llama3_scaled(inv_freq, scaling), 1.0


def _longrope(dim: int, base: float, exponents: torch.Tensor, scaling: RopeScaling,
              max_positions: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE (`su`): each frequency divided by its own factor, cos/sin scaled by `attention_factor`.

    Which factor set: HF switches on the sequence length it sees (long factors once a sequence outgrows
    `original_max_position_embeddings`, and then recomputes the whole sequence's KV with them). A paged engine
    cannot re-rotate cached keys, so, as vLLM does, the set is chosen once for the engine by the longest sequence
    it serves: the long factors when that (`max_positions`) exceeds the original length, the short ones otherwise.
    Every sequence's keys and queries thus use one set, and a cached prefix is valid for every request. It equals
    HF for any sequence when `max_positions <= original` (short) and, otherwise, for sequences longer than the
    original length (long); a shorter sequence of a long-context engine gets the long factors where HF uses the
    short ones (vLLM's behaviour too).
    """
    factors = scaling.long_factor if max_positions > scaling.original_max_position_embeddings else scaling.short_factor
    if len(factors) != dim // 2:
        raise ValueError(f"LongRoPE needs {dim // 2} factors (rotary_dim / 2), got {len(factors)}")
    inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)
    attention_factor = scaling.attention_factor
    if attention_factor is None:  # the LongRoPE paper's default, as HF computes it
        attention_factor = 1.0 if scaling.factor <= 1.0 else math.sqrt(
            1 + math.log(scaling.factor) / math.log(scaling.original_max_position_embeddings))
    return inv_freq, attention_factor


def _yarn(dim: int, base: float, pos_freqs: torch.Tensor, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss): frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those that turn more than `beta_fast` times are kept, a linear ramp over
    the dimensions between; cos/sin scaled by the attention factor (`attention_factor`, the config parser's mscale).
    The same float32 operations, in the same order, as transformers' `_compute_yarn_parameters`."""
    low, high = (_yarn_correction_dim(rotations, dim, base, scaling.original_max_position_embeddings)
                 for rotations in (scaling.beta_fast, scaling.beta_slow))
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    interpolated, extrapolated = 1.0 / (scaling.factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation_factor) + extrapolated * extrapolation_factor
    return inv_freq, 1.0 if scaling.attention_factor is None else scaling.attention_factor


def _yarn_correction_dim(rotations: float, dim: int, base: float, original_positions: int) -> float:
    """The (fractional) dimension whose frequency turns `rotations` times over `original_positions`."""
    return (dim * math.log(original_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)
