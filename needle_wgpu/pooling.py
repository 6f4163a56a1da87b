"""Embeddings of a dense model: its final hidden states (after the output norm, llama.cpp's
``result_norm``) pooled over the positions and L2-normalised, as llama.cpp's server answers
``/v1/embeddings`` (``embd_normalize`` 2). Pure Python: it runs in Pyodide.

The pooling is the file's ``{arch}.pooling_type`` (llama.cpp's ``llama_pooling_type``): mean
when the file says nothing or "none" (OpenAI's embeddings need one vector per input); a rank
(reranker) file has no embedding to give and is refused by ``Model.embed``.
"""

from __future__ import annotations

import math

POOLINGS = ("mean", "cls", "last")
_BY_CODE = {0: "mean", 1: "mean", 2: "cls", 3: "last", 4: ""}  # 0 none, 4 rank (llama.cpp's numbering)


def file_pooling(gguf, arch: str) -> str:
    """The pooling a GGUF file declares ("" for a reranker's rank pooling or an unknown code)."""
    try:
        code = gguf.get_int(f"{arch}.pooling_type", 1)
    except Exception:  # a key of the wrong type: the default
        code = 1
    return _BY_CODE.get(code, "")


def rows_needed(pooling: str, positions: int) -> range:
    """Which positions' hidden states a pooling reads."""
    if pooling == "cls":
        return range(0, min(1, positions))
    if pooling == "last":
        return range(max(positions - 1, 0), positions)
    return range(positions)


class Pool:
    """A running pooling of hidden-state rows (``add`` them in position order), then ``vector``."""

    def __init__(self, pooling: str, width: int):
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}")
        self.pooling, self.width = pooling, width
        self.sums = [0.0] * width
        self.count = 0

    def add(self, row) -> None:
        if self.pooling == "mean":
            self.sums = [a + b for a, b in zip(self.sums, row)]
        else:  # cls and last: rows_needed gives exactly the one row
            self.sums = list(row)
        self.count += 1

    def vector(self) -> list:
        """The pooled row, scaled to unit L2 norm (a zero row stays zero, as llama.cpp's)."""
        if self.count == 0:
            return [0.0] * self.width
        pooled = [s / self.count for s in self.sums] if self.pooling == "mean" else self.sums
        norm = math.sqrt(math.fsum(v * v for v in pooled))
        return [v / norm for v in pooled] if norm > 0 else [0.0] * self.width
