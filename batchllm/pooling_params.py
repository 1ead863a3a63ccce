"""What a pooling request (an embedding, a classification) wants from its prompt's hidden states. No torch here."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("last", "mean", "cls")
TASKS = ("generate", "embed", "classify", "score")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """`pooling`: the final hidden state of the last token, the mean over every token, or the first token's;
    `normalize`: to unit L2 norm; `classify`: through the model's classification head (logits)."""

    pooling: str = "last"
    normalize: bool = False
    classify: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.pooling, str) or self.pooling not in POOLING_TYPES:
            raise ValueError(f"PoolingParams.pooling must be one of {', '.join(map(repr, POOLING_TYPES))}, got "
                             f"{self.pooling!r}")
        for name in ("normalize", "classify"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PoolingParams.{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def reads_every_token(self) -> bool:
        """Mean and CLS pooling read hidden states that a prefix-cache hit would not compute."""
        return self.pooling != "last"
