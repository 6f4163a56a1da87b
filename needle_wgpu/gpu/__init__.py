"""Device layer: back-end neutral GPU access (see device.py) and the back ends."""

from .device import Binding, Buffer, Device, KernelKey, Limits, Plan, UniformArena


def open_device(backend: str = "auto", **options) -> Device:
    """Open a GPU device: "native" (wgpu-py), "browser" (Pyodide + navigator.gpu) or "auto"."""
    import sys

    if backend == "browser" or (backend == "auto" and sys.platform == "emscripten"):
        from .browser import BrowserDevice

        return BrowserDevice(**options)
    from .native import NativeDevice

    return NativeDevice(**options)


__all__ = ["Binding", "Buffer", "Device", "KernelKey", "Limits", "Plan", "UniformArena", "open_device"]
