"""A device that allocates nothing: a session opened on it counts, by kind, the bytes the same
session would take on a real device (``info``'s GPU memory before a model loads). The code that
counts is the code that allocates, so the figure cannot drift from what a load does."""

from __future__ import annotations

from ..errors import DeviceError
from .device import Device, Limits

# WebGPU's default limits: what a page or a default adapter grants unless more is asked for.
WEBGPU_DEFAULT_LIMITS = Limits(max_storage_binding=128 << 20, max_buffer=256 << 20, max_workgroup_storage=16384,
                               max_invocations=256, max_storage_buffers=8)


class SizingDevice(Device):
    adapter_name = "sizing (allocates nothing)"

    def __init__(self, limits: Limits = WEBGPU_DEFAULT_LIMITS, software_rasterizer: bool = False):
        super().__init__()
        self.limits = limits
        self.software_rasterizer = software_rasterizer  # what a session sizes by the adapter's kind

    def _create_buffer(self, size, usage, label):
        return None

    def _write(self, handle, data, offset):
        pass

    def _destroy_buffer(self, handle):
        pass

    def _submit_nothing(self):
        pass

    def _read(self, handle, offset, size):
        raise DeviceError("a sizing device holds no data")

    def _submit(self, encoded, copies):
        raise DeviceError("a sizing device runs nothing")

    _submit_steps = _submit

    def wait_idle(self, what="GPU work"):
        pass

    def destroy(self):
        pass
