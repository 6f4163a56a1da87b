"""NumPy float32 reference of Needle 3, written to read like the spec (docs: shared/spec/needle3.md).

Every GPU kernel is parity-tested against one of these functions; `ReferenceModel` strings
them together into the whole model.
"""

from .needle3.cache import KVCache, KvPrecision
from .needle3.model import ReferenceModel, saturate_ids

__all__ = ["ReferenceModel", "KVCache", "KvPrecision", "saturate_ids"]
