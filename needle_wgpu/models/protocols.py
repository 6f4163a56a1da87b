"""What a model family provides to ``api.Model`` (docs/api.md), named once.

A family is a module (``families.py``: ``sniff``, ``read``, ``open``, ``describe``,
``NUMERICS``) whose ``open`` returns a GPU model with these names:

- ``geometry`` (``vocab``, ``head_rows``, ``max_seq_len``, ``num_layers``), ``tokenizer`` (or
  None), ``chat`` (a chat format: below), ``name`` (what the file calls itself), ``warnings``
  (problems of a file that loaded), ``device`` (its ``gpu.device.Device``), ``describe()``;
- ``session(context=None, kv=None, **heads)``: a ``models.session.ChunkedSession``;
- ``capabilities``: a ``Capabilities`` record. The API reads it, never probes attributes: what
  a record says the model lacks is refused with ``UnsupportedModelError`` (or ``DepthError``).

A chat format (``prompt.Needle3Chat``, ``chat.dense.DenseChat``) has ``request_ids``,
``render_ids``, ``stop_ids``, ``parse`` and declares ``template`` (the file's chat template, or
None), ``renders_reply_ids`` (the next rendering splices a reply's sampled ids back in) and
``tool_calls`` (its ``chat.tool_calls.ToolCallFormat``: how calls are written, parsed and
constrained).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats.cact import EMBEDDING_HEAD


@dataclass(frozen=True)
class Capabilities:
    """What a loaded model can do beyond plain generation."""

    heads: frozenset = frozenset()  # probe heads the file has (Needle 3 manifest codes: 1 embedding, 3 router)
    confidence: bool = False  # a confidence head whose host finish fits the budget (§7)
    depth_ladder: bool = False  # elastic depth (Needle 3 §10): rungs over the same weights, speculative drafts
    numerics: tuple = ("float",)  # the numerics it runs (needle_wgpu.models.needle3_numerics)
    mask: bool = False  # constrained decoding: the sampler takes an allowed-id mask
    verify: bool = False  # speculative verify: a sampler after every position of a chunk
    batch: bool = False  # ``gpu_model.batch(capacity)``: decode steps of several sessions in one submit (models.batch)
    pooling: str = ""  # dense embeddings: how the final hidden states pool (pooling.POOLINGS); "" for none

    @property
    def embeds(self) -> bool:
        """Whether ``Model.embed`` serves this model: an embedding head (Needle 3's code 1) or a
        pooling of the last hidden states (dense files)."""
        return EMBEDDING_HEAD in self.heads or bool(self.pooling)
