"""The one exception family for everything a user can cause.

Every error raised on purpose by needle-wgpu is a ``NeedleError``; callers that want to keep a
service alive catch that one class. Subclasses say which kind of problem it was.
"""


class NeedleError(Exception):
    """Base of every error needle-wgpu raises on purpose."""


class ContainerError(NeedleError):
    """A model file is corrupt, truncated or inconsistent with its own header."""


class NonFiniteWeightsError(ContainerError):
    """A model file loaded but its weights hold NaN or infinity: it cannot give real outputs."""


class UnsupportedModelError(NeedleError):
    """A model file is well formed but uses a feature this engine does not implement."""


class InputError(NeedleError):
    """A request is structurally invalid (for example tools JSON that does not parse)."""


class DeviceError(NeedleError):
    """The GPU device failed: no adapter, a limit the model needs is missing, or an error scope."""


class DeviceLostError(DeviceError):
    """The GPU device was lost; the session is unusable but a new one can be created."""


class OutOfMemoryError(DeviceError):
    """The GPU could not allocate what the model or session needs."""


class DeviceLimitError(DeviceError):
    """The model needs more than the device's limits allow (after splitting where possible)."""


class ContextFullError(NeedleError):
    """A session reached the model's max_seq_len; nothing more fits (Needle 3 spec §0 item 8)."""


class DepthError(InputError):
    """A depth the model file cannot give (elastic depth, Needle 3 spec §10): not a whole number,
    outside the file's ladder, or asked of a family without one."""
