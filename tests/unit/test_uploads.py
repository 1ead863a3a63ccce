"""`rows_to_device`: an image step's pixel pieces joined and converted in one copy (model/uploads.py), against
`torch.cat` and a cast done separately."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchllm.model.uploads import rows_to_device


def test_rows_to_device_joins_and_converts_the_pieces() -> None:
    gen = np.random.default_rng(0)
    pieces = [gen.standard_normal((5, 6), dtype=np.float32), torch.randn(3, 6), gen.standard_normal((1, 6),
                                                                                                   dtype=np.float32)]
    expected = torch.cat([torch.as_tensor(piece) for piece in pieces])
    joined = rows_to_device(pieces, torch.device("cpu"), torch.bfloat16)
    assert joined.dtype == torch.bfloat16 and joined.shape == (9, 6)
    assert torch.equal(joined, expected.to(torch.bfloat16))
    kept = rows_to_device(pieces, torch.device("cpu"))
    assert kept.dtype == torch.float32 and torch.equal(kept, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pinned memory)")
def test_rows_to_device_uploads_from_pinned_memory() -> None:
    pieces = [torch.randn(4, 3, 8, 8), torch.randn(2, 3, 8, 8)]
    joined = rows_to_device(pieces, torch.device("cuda"), torch.float16)
    assert joined.is_cuda and torch.equal(joined.cpu(), torch.cat(pieces).half())
