"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the row's suffix.

Runs on the host for every decoding row of every step, so each request keeps an index per n-gram length
(n-gram → where its latest occurrence ends), extended only by the tokens appended since the last call.
"""

from __future__ import annotations


class _RequestIndex:
    __slots__ = ("latest", "num_indexed")

    def __init__(self, num_lengths: int) -> None:
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_lengths)]
        self.num_indexed = 0  # n-grams ending before this position are in `latest`


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _RequestIndex] = {}

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix n-gram
        (n in [min_n, max_n]) of `token_ids`, which only grows between calls for one request."""
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _RequestIndex(self.max_n - self.min_n + 1)
        # Index every n-gram that ends before the last position: occurrences earlier than the suffix itself.
        for end in range(index.num_indexed, length - 1):
            for i, n in enumerate(range(self.min_n, self.max_n + 1)):
                if end + 1 >= n:
                    index.latest[i][tuple(token_ids[end + 1 - n:end + 1])] = end
        index.num_indexed = max(index.num_indexed, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.latest[n - self.min_n].get(tuple(token_ids[length - n:]))
            if end is not None:
                return token_ids[end + 1:end + 1 + k]
        return []

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
