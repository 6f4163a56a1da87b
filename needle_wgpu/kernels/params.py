"""Small parameters on the GPU: every FP16 tensor in one buffer, the permutations as u32."""

from __future__ import annotations

import struct

from ..errors import ContainerError
from ..formats.cact import FP16, FP32, CactFile
from ..gpu.device import Device


class Fp16Store:
    """All FP16 tensors of a container in one storage buffer, read in WGSL with ``half_at``.

    Each tensor starts at a 4-byte-aligned byte offset; ``offset(name)`` is in halves. The bytes
    are the file's own (no conversion), so the buffer is exactly the FP16 tensor bytes plus
    alignment padding.
    """

    def __init__(self, device: Device, cact: CactFile, label: str = "fp16"):
        self.offsets: dict = {}
        layout, size = [], 0
        for name, tensor in cact.tensors.items():
            if tensor.dtype == FP16:
                self.offsets[name] = size // 2
                layout.append((size, tensor))
                size += (tensor.nbytes + 3) // 4 * 4
        self.buffer = device.buffer(size, label=label, kind="weights")
        for at, tensor in layout:
            device.write(self.buffer, tensor.data, at)

    def offset(self, name: str) -> int:
        return self.offsets[name]


def permutation_words(cact: CactFile) -> bytes:
    """hada.p1 then hada.p2 as u32 (§8: stored as FP32 floats holding integers), validated."""
    out = bytearray()
    for name in ("hada.p1", "hada.p2"):
        tensor = cact[name]
        assert tensor.dtype == FP32
        values = struct.unpack(f"<{tensor.size}f", tensor.data)
        ints = [int(v) for v in values if v == v and 0 <= v < tensor.size and v == int(v)]
        if len(ints) != tensor.size or len(set(ints)) != tensor.size:
            raise ContainerError(f"{name}: not a permutation of 0..{tensor.size - 1}")
        out += struct.pack(f"<{tensor.size}I", *ints)
    return bytes(out)
