"""Small parameters on the GPU: every FP16 tensor in one buffer, the permutations as u32."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ...errors import ContainerError
from ...formats.cact import FP16, FP32, CactFile
from ...gpu.device import Binding, Device

# WebGPU's minStorageBufferOffsetAlignment is at most 256 on every adapter.
BINDING_ALIGN = 256
MHC_SLICES = (("a_pre", 1, 0), ("a_post", 1, 0), ("a_res", 1, 0), ("b_pre", 1, 1), ("b_post", 1, 1),
              ("b_res", 1, 2))


@dataclass(frozen=True)
class Fp16Window:
    """A bound range of the FP16 buffer; ``offset(name)`` is in halves from the range's start."""

    binding: Binding
    base: int
    offsets: dict

    def offset(self, name: str) -> int:
        return self.offsets[name] - self.base


class Fp16Store:
    """All FP16 tensors of a container in one storage buffer, read in WGSL with ``half_at``.

    The bytes are the file's own (no conversion). Layout: each layer's tensors, followed by that
    layer's slices of the mHC scalars (``layers.{l}.mhc.a_pre`` ...), then every other FP16
    tensor. So a kernel of one layer binds only that layer's window (``layer_window``), which
    keeps every binding small whatever the device's storage-binding limit.
    """

    def __init__(self, device: Device, cact: CactFile, label: str = "fp16"):
        self.offsets: dict = {}
        self.nbytes: dict = {}
        self._layout: list = []
        self._size = 0
        g = cact.geometry
        n = g.mhc_lanes
        placed = set()
        for layer in range(g.num_layers):
            prefix = f"layers.{layer}."
            for name, tensor in cact.tensors.items():
                if name.startswith(prefix) and tensor.dtype == FP16:
                    self._place(name, tensor.data)
                    placed.add(name)
            for short, _, power in MHC_SLICES:
                width = n ** power
                half = 2 * width
                self._place(f"{prefix}mhc.{short}", cact[f"mhc.{short}"].data[layer * half : (layer + 1) * half])
        for name, tensor in cact.tensors.items():
            if tensor.dtype == FP16 and name not in placed:
                self._place(name, tensor.data)
        self.buffer = device.buffer(self._size, label=label, kind="weights")
        for at, data in self._layout:
            device.write(self.buffer, data, at)
        del self._layout

    def _place(self, name, data):
        self.offsets[name] = self._size // 2
        self.nbytes[name] = len(data)
        self._layout.append((self._size, data))
        self._size += (len(data) + 3) // 4 * 4

    def offset(self, name: str) -> int:
        return self.offsets[name]

    def window(self, names) -> Fp16Window:
        """The smallest aligned range holding the named tensors."""
        begin = min(2 * self.offsets[n] for n in names) // BINDING_ALIGN * BINDING_ALIGN
        end = max(2 * self.offsets[n] + self.nbytes[n] for n in names)
        end = min(self.buffer.size, (end + 15) // 16 * 16)
        return Fp16Window(Binding(self.buffer, begin, end - begin), begin // 2, self.offsets)

    def layer_window(self, layer: int) -> Fp16Window:
        prefix = f"layers.{layer}."
        return self.window([n for n in self.offsets if n.startswith(prefix)])


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
