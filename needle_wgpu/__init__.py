"""needle-wgpu: a WebGPU inference engine for small language models (Needle 3 and dense GGUF models)."""

import sys

from .errors import (ContainerError, DepthError, DeviceError, DeviceLimitError, DeviceLostError, InputError,
                     NeedleError, OutOfMemoryError, UnsupportedModelError)

from .agent import Agent, AgentResult, Field, Tool, tool
from .api import Model
from .default_model import default_model as _default_model

__version__ = "0.1.0"


def load(source=None, device=None, progress=None, numerics="float", depth=None):
    """Open a model file (a path or its bytes: .cact or GGUF, told by its magic) on a GPU device
    and return an ``api.Model``. ``progress(stage, done, total)`` is called while loading.
    No source: the default model (``default_model.default_model``: the installed SmolLM2-135M-Instruct).
    ``numerics``: "float" (default) or "deploy" (Needle 3: upstream's quant=True arithmetic).
    ``depth`` (Needle 3 only): run that rung of the file's ladder (spec §10; ``DepthError``
    for a depth the file cannot give)."""
    if source is None:
        source = _default_model(lambda message: print(f"needle-wgpu: {message}", file=sys.stderr))

    return Model.load(source, device=device, progress=progress, numerics=numerics, depth=depth)

__all__ = ["NeedleError", "ContainerError", "UnsupportedModelError", "InputError", "DepthError", "DeviceError",
           "DeviceLostError", "OutOfMemoryError", "DeviceLimitError", "load", "Agent", "AgentResult", "Field", "Tool",
           "tool", "__version__"]
