"""needle-wgpu: a WebGPU inference engine for small language models (Needle 3 first)."""

from .errors import (ContainerError, DeviceError, DeviceLimitError, DeviceLostError, InputError,
                     NeedleError, OutOfMemoryError, UnsupportedModelError)

__version__ = "0.1.0"

__all__ = ["NeedleError", "ContainerError", "UnsupportedModelError", "InputError", "DeviceError",
           "DeviceLostError", "OutOfMemoryError", "DeviceLimitError", "__version__"]
