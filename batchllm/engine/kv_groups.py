"""How the layers of a model with sliding-window layers share one KV pool (the hybrid KV cache).

A window layer needs only the blocks its window can still see; a full-attention layer needs every block. Both
kinds draw on one pool whose block is a page of `num_slots` layers' K/V: the layers are cut into groups of
`num_slots` layers of the same window, and each group keeps its own block table per request. Layer `i` keeps
its K/V in storage slot `layer_slot[i]`, at the block ids of group `layer_group[i]`'s table. Gemma 3 (8 full and
40 window layers) gets 6 groups of 8 layers: one full group and five window groups, whose old blocks return to
the pool as the window slides. A model of one window kind (Llama: none; Mistral: every layer) is one group of all
its layers, each layer its own slot: the plain KV cache (with Mistral's old blocks freed).

A proposer with K/V of its own (a draft model, an EAGLE head) keeps it in a group of its own, full attention and
holding no target layer (`drafter_group`): its layers read that group's table, in a cache of their own that shares
the pool's block ids (a block of that group holds only the proposer's K/V).

A request's table is sent to the runner interleaved: logical block `j` of group `g` at entry `j * G + g`, so every
group's table grows by one block at the same time and the interleaved table only ever grows (freed blocks keep
their stale ids there: the kernels never read outside a window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroupLayout:
    group_windows: tuple[int | None, ...]  # each group's window (None: full attention)
    layer_group: tuple[int, ...]  # each layer's group
    layer_slot: tuple[int, ...]  # each layer's storage slot, in 0..num_slots - 1
    drafter_group: int | None = None  # the group of a proposer's own K/V (no target layer in it)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_slots(self) -> int:
        return max(self.layer_slot) + 1

    @property
    def frees_blocks(self) -> bool:
        """Whether any group lets blocks go: the hybrid KV manager is needed."""
        return any(window is not None for window in self.group_windows)


def plan_kv_groups(layer_windows: list[int | None]) -> KVGroupLayout:
    """Groups of equal size (the gcd of the layer counts of each window), each of one window, layers in order."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    windows: list[int | None] = []
    layer_group, layer_slot = [0] * len(layer_windows), [0] * len(layer_windows)
    for window, layers in by_window.items():
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_slot[layer] = len(windows), slot
            windows.append(window)
    return KVGroupLayout(tuple(windows), tuple(layer_group), tuple(layer_slot))


def with_drafter_group(layout: KVGroupLayout) -> KVGroupLayout:
    """`layout` and, last, a full-attention group for a proposer's K/V: it keeps every block, as a full group."""
    return KVGroupLayout((*layout.group_windows, None), layout.layer_group, layout.layer_slot, layout.num_groups)


def single_group(num_layers: int) -> KVGroupLayout:
    """Every layer in one full-attention group, each its own slot: the plain KV cache."""
    return KVGroupLayout((None,), (0,) * num_layers, tuple(range(num_layers)))
