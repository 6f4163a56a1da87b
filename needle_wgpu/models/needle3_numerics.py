"""Which arithmetic a Needle 3 model runs (spec §4.9, §U d, §U e): the choice and its KV mode.

``numerics="float"`` is the f32 forward of §4.1-§4.8 (upstream quant=False), the default.
``numerics="deploy"`` is upstream's quant=True forward, what upstream ships and fine-tunes
through: 8-bit activation fake-quant (A8) at the seven points of §4.9, the query A8 per head,
and K/V quantised by the KV mode the header's kv_bits names (8: int8 per head; 2, 3, 4: CQ at
group 64). A caller may override the KV mode. Plain Python: the GPU model imports this in the
browser too, and the NumPy reference uses the same rules.
"""

from __future__ import annotations

from ..errors import InputError, UnsupportedModelError
from ..inputs import TEXT_TYPES, _plain, as_text

NUMERICS = ("float", "deploy")
KV_MODES = ("f32", "int8", "cq2", "cq3", "cq4")  # deploy; float numerics keep f32 / int8 only
HEADER_KV_BITS = {0: "int8", 8: "int8", 2: "cq2", 3: "cq3", 4: "cq4"}  # §U d: 0 reads as 8


def choice(numerics) -> str:
    """``numerics`` as one of NUMERICS (text, any case); anything else is an ``InputError``."""
    numerics = _plain(numerics)
    if isinstance(numerics, TEXT_TYPES):
        text = as_text(numerics, "numerics").lower()
        if text in NUMERICS:
            return text
    raise InputError(f"numerics={numerics!r}: expected one of {', '.join(NUMERICS)}")


def header_kv_mode(kv_bits: int) -> str:
    """The KV mode a model was post-trained for (§U d): header kv_bits 8 (or 0) -> "int8",
    2/3/4 -> "cq2"/"cq3"/"cq4"; any other value is refused (``UnsupportedModelError``)."""
    mode = HEADER_KV_BITS.get(kv_bits)
    if mode is None:
        raise UnsupportedModelError(f"header kv_bits {kv_bits}: deploy numerics know 8 (int8) and 2, 3, 4 "
                                    "(CQ at group 64) (§U d)")
    return mode


def kv_mode(kv, numerics: str, kv_bits: int) -> str:
    """The KV mode of a session: ``kv`` None -> the default (float: "f32"; deploy: the header's
    kv_bits); else text, any case. Float numerics: "int8" or anything else meaning "f32" (the
    long-standing rule), but a CQ mode is refused there (it exists only in deploy numerics).
    Deploy: one of KV_MODES, else ``InputError``."""
    kv = _plain(kv)
    if kv is None:
        return header_kv_mode(kv_bits) if numerics == "deploy" else "f32"
    text = as_text(kv, "kv").lower() if isinstance(kv, TEXT_TYPES) else None
    if numerics == "deploy":
        if text not in KV_MODES:
            raise InputError(f"kv={kv!r}: deploy numerics take one of {', '.join(KV_MODES)} (or None: the "
                             "header's kv_bits)")
        return text
    if text is not None and text.startswith("cq"):
        raise InputError(f"kv={kv!r}: CQ K/V exist only with numerics='deploy'")
    return "int8" if text == "int8" else "f32"


def cq_bits(mode: str) -> int:
    """The CQ width of a KV mode ("cq3" -> 3), 0 for "f32" and "int8"."""
    return int(mode[2:]) if mode.startswith("cq") else 0
