"""Expert parallelism's dispatch / combine (model/layers/expert_parallel.py) in two gloo processes, against the
single-process torch reference `moe_reference.fused_moe` over all the experts.

Each rank holds 2 of 4 experts (biases included: an expert's down bias must be added once per pair, by the
owner) and runs the reference on the rows it receives. The cases: random routing over uneven token shares,
a rank whose experts no token chose, one expert taking every token (top-1 and top-2), fewer tokens than ranks.
This file is also the ranks' script: the test runs it twice as `python test_expert_parallel.py RANK ...`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch

EXPERTS, HIDDEN, INTER = 4, 8, 6


def _cases() -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)

    def routed(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        weights = torch.softmax(torch.randn(ids.shape, generator=gen), dim=-1)
        return {"hidden": torch.randn(ids.shape[0], HIDDEN, generator=gen), "ids": ids, "weights": weights}

    def top2(tokens: int, choices: list[int]) -> torch.Tensor:
        return torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=gen)[:2]]
                            for _ in range(tokens)])

    return {
        "random, 7 tokens (shares 4 and 3)": routed(top2(7, [0, 1, 2, 3])),
        "rank 1's experts unchosen": routed(top2(5, [0, 1])),
        "expert 3 takes every token (top-1)": routed(torch.full((6, 1), 3)),
        "expert 0 in every token's top-2": routed(torch.stack([torch.zeros(5, dtype=torch.long),
                                                               torch.randint(1, 4, (5,), generator=gen)], dim=1)),
        "one token, two ranks": routed(top2(1, [1, 2, 3])),
        "three tokens (shares 2 and 1)": routed(top2(3, [0, 1, 2, 3])),
    }


def _experts() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"w13": torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen),
            "w2": torch.randn(EXPERTS, HIDDEN, INTER, generator=gen),
            "b13": torch.randn(EXPERTS, 2 * INTER, generator=gen), "b2": torch.randn(EXPERTS, HIDDEN, generator=gen)}


def _rank_main(rank: int, init_method: str, out_path: str) -> None:
    from batchllm.distributed.parallel_state import destroy_model_parallel, get_ep, init_model_parallel
    from batchllm.kernels import moe_reference
    from batchllm.model.layers.expert_parallel import expert_parallel_moe

    torch.set_num_threads(1)
    init_model_parallel(rank, 2, 1, "gloo", init_method, timeout_s=60, expert_parallel=True)
    ep, e = get_ep(), _experts()
    local = ep.local_experts(EXPERTS)
    w13, w2, b13, b2 = (e[name][local.start:local.stop] for name in ("w13", "w2", "b13", "b2"))
    results = {}
    for name, case in _cases().items():
        received = []

        def run_local_experts(rows, weights, ids):
            received.append(rows.shape[0])
            return moe_reference.fused_moe(rows, w13, w2, weights, ids, "silu", b13, b2)

        out = expert_parallel_moe(case["hidden"], case["weights"], case["ids"], ep, len(local), run_local_experts)
        results[name] = (out, sum(received))
    torch.save(results, out_path)
    destroy_model_parallel()


def test_dispatch_and_combine_equal_the_single_process_reference(tmp_path: Path) -> None:
    from batchllm.kernels import moe_reference

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    outs = [tmp_path / f"rank{rank}.pt" for rank in range(2)]
    ranks = [subprocess.Popen([sys.executable, __file__, str(rank), init_method, str(outs[rank])])
             for rank in range(2)]
    try:
        assert [rank.wait(timeout=120) for rank in ranks] == [0, 0]
    finally:
        for rank in ranks:  # a rank left waiting in a collective for one that failed
            rank.kill()
    results = [torch.load(out) for out in outs]
    e = _experts()
    for name, case in _cases().items():
        expected = moe_reference.fused_moe(case["hidden"], e["w13"], e["w2"], case["weights"], case["ids"], "silu",
                                           e["b13"], e["b2"])
        for rank, result in enumerate(results):
            out, received = result[name]
            assert out.shape == expected.shape, name
            assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5), (name, rank)
            # Rank r received exactly the (token, expert) pairs whose expert it holds.
            owned = range(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
            assert received == sum(int(expert) in owned for expert in case["ids"].flatten()), (name, rank)
    assert results[0]["rank 1's experts unchosen"][1] == 10 and results[1]["rank 1's experts unchosen"][1] == 0


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
