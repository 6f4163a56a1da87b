"""The device layer: what model code may ask of a GPU, independent of the back end.

Model code talks only to ``Device``; ``native.py`` implements it over wgpu-py on the desktop and
``browser.py`` over Pyodide's JS FFI. Everything here is plain Python (no numpy): it also runs
in the browser.

Design (spec anchors): pipelines cached by a hashable ``KernelKey``; bind groups built once per
shape by the caller and replayed; per-dispatch parameters live in one uniform arena written at
build time; a ``Plan`` is a prebuilt list of dispatches that one ``run`` records into a single
compute pass and a single submit.
"""

from __future__ import annotations

import struct
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..errors import DeviceError, DeviceLimitError
from .shaders import shader_source, struct_layout


def _thread_clock():
    """The calling thread's CPU clock; where the platform has none (a WebAssembly build may
    not), the wall clock, which on Pyodide's one thread is the same thing."""
    try:
        time.thread_time()
        return time.thread_time
    except (AttributeError, OSError):
        return time.perf_counter


thread_clock = _thread_clock()

# Decode steps per round by adapter kind, as measured (BENCHMARKS.md, "Host cost per token"): on
# a GPU the host's time is the bound, and 4 steps a round cut it 2.3x (1.75 -> 0.76 ms a token on
# SmolLM2); on a software rasterizer the GPU's own time is 100x the host's, so a round gains
# nothing and would only make streamed text arrive in bursts.
ROUND_TOKENS = {"hardware": 4, "software": 1}

UNIFORM_ALIGN = 256


@dataclass(frozen=True)
class KernelKey:
    """One pipeline: a WGSL file of shaders/, an entry point, and the constants it is built with.

    ``consts`` are (NAME, value) pairs prepended to the source as WGSL ``const`` declarations:
    variants (bit width, workgroup size, tile) are explicit and hashable.
    """

    family: str
    entry: str = "main"
    consts: tuple = ()

    def header(self) -> str:
        lines = []
        for name, value in self.consts:
            if isinstance(value, bool):
                lines.append(f"const {name}: bool = {'true' if value else 'false'};")
            elif isinstance(value, float):
                lines.append(f"const {name}: f32 = {value!r};")
            elif value < 0:
                lines.append(f"const {name}: i32 = {value};")
            else:
                lines.append(f"const {name}: u32 = {value}u;")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Limits:
    max_storage_binding: int
    max_buffer: int
    max_workgroup_storage: int
    max_invocations: int
    max_storage_buffers: int


@dataclass(eq=False)
class Buffer:
    """A GPU buffer: the back end's handle plus its size and a label for messages. ``kind``:
    what it holds (``Counters.bytes_allocated``); "weights" and "shared" (device-wide scratch
    that plans of any session bind) are never freed by a session's close."""

    handle: object
    size: int
    label: str
    kind: str = "scratch"
    freed: bool = False


@dataclass(frozen=True)
class Pending:
    """A readback ``Device.run_steps`` scheduled: ``Device.collect`` returns its bytes."""

    buffer: "Buffer"
    offset: int
    size: int
    staged: object = None  # the back end's copy made inside the submit (None: read it afterwards)


# Kinds a session never owns: the model's weights, and the device-wide buffers a kernel makes
# once and every plan shares (the sampler's scratch, placeholders).
UNOWNED_KINDS = frozenset({"weights", "shared"})

_owners = threading.local()  # the stack of lists ``recording`` collects new buffers into


@contextmanager
def recording(owned: list):
    """Collect every buffer this thread allocates meanwhile (except ``UNOWNED_KINDS``) into
    ``owned``: what a session makes for itself, freed by its close. Nested recordings collect
    into the innermost only."""
    stack = _owners.__dict__.setdefault("stack", [])
    stack.append(owned)
    try:
        yield owned
    finally:
        stack.pop()


def _forget(counters, size: int) -> None:
    """A Buffer Python dropped without ``free``: the back end releases it with the object."""
    counters.live_bytes -= size


@dataclass(frozen=True)
class Binding:
    """A range of a buffer bound to one binding slot (the whole buffer when size is None)."""

    buffer: Buffer
    offset: int = 0
    size: int | None = None


@dataclass
class Dispatch:
    pipeline: object
    bind_group: object
    groups: tuple
    label: str = ""


@dataclass
class Counters:
    """What the benchmark reports: work submitted and bytes moved, counted at the device layer."""

    dispatches: int = 0
    submits: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_allocated: dict = field(default_factory=dict)
    live_bytes: int = 0  # allocated and not yet freed (``Device.free``) nor released
    # The calling thread's CPU time (``thread_clock``) spent encoding and submitting passes, and
    # reading back (mostly waiting for the GPU), and the readback's wall time: the host's cost
    # per token the benchmark splits out (GPU work on other threads does not count).
    encode_cpu_s: float = 0.0
    read_cpu_s: float = 0.0
    read_wall_s: float = 0.0

    def allocate(self, kind: str, size: int) -> None:
        self.bytes_allocated[kind] = self.bytes_allocated.get(kind, 0) + size


class UniformArena:
    """All kernel parameters of a plan in uniform buffers, each dispatch at an aligned offset.

    Ops call ``struct``: the values by the names of the kernel's WGSL ``struct Params``, laid
    out as WGSL lays that struct out (``gpu/shaders.py``). ``add`` packs bare 32-bit words in the
    order given (u32 for ints, f32 for floats). When a buffer is full the arena starts another
    of the same capacity (bindings already handed out keep theirs), so a plan of any length
    fits: its uniforms take as many blocks as its dispatches need.
    """

    def __init__(self, device: "Device", capacity: int = 1 << 16, label: str = "uniforms"):
        self.device = device
        self.capacity = capacity
        self.label = label
        self.blocks = [device.buffer(capacity, label=label, usage="uniform")]
        self.used = 0

    @property
    def buffer(self) -> Buffer:
        """The block being filled."""
        return self.blocks[-1]

    def struct(self, kernel: KernelKey | str, struct_name: str = "Params", /, **values) -> Binding:
        """One dispatch's parameters: ``values`` by member name of ``struct_name`` in the WGSL
        source of ``kernel`` (its ``KernelKey`` or family name). Padding members (``_pad0``) are
        written as zeros and never given; a missing, unknown or mistyped member is refused,
        named, before anything is written."""
        family = kernel.family if isinstance(kernel, KernelKey) else kernel
        return self._place(struct_layout(family, struct_name).pack(values))

    def add(self, *values) -> Binding:
        """Bare 32-bit words in the order given (u32 for ints, f32 for floats)."""
        return self._place(pack_words(values))

    def _place(self, data: bytes) -> Binding:
        size = max(16, (len(data) + 15) // 16 * 16)
        if size > self.capacity:
            raise DeviceError(f"{self.label}: {size} bytes of parameters exceed the {self.capacity}-byte block")
        if self.used + size > self.capacity:
            self.blocks.append(self.device.buffer(self.capacity, label=f"{self.label}.{len(self.blocks)}",
                                                  usage="uniform"))
            self.used = 0
        offset = self.used
        self.device.write(self.buffer, data.ljust(size, b"\0"), offset)
        self.used = (offset + size + UNIFORM_ALIGN - 1) // UNIFORM_ALIGN * UNIFORM_ALIGN
        return Binding(self.buffer, offset, size)


def pack_words(values) -> bytes:
    out = bytearray()
    for value in values:
        if isinstance(value, float):
            out += struct.pack("<f", value)
        else:
            out += struct.pack("<I", value & 0xFFFFFFFF)
    return bytes(out)


class Plan:
    """A prebuilt sequence of dispatches, replayed as one compute pass and one submit."""

    def __init__(self, device: "Device", label: str):
        self.device = device
        self.label = label
        self.dispatches: list = []
        self.encoded = None  # the back end's ready-to-encode form of the dispatches (Device.encoded)

    def add(self, key: KernelKey, bindings: list, groups, label: str = "") -> None:
        pipeline = self.device.pipeline(key)
        bind_group = self.device.bind_group(pipeline, bindings)
        groups = tuple(groups) + (1,) * (3 - len(tuple(groups)))
        limit = self.device.max_workgroups_per_dimension
        if any(g > limit for g in groups):
            raise DeviceLimitError(f"{label or key.family}: {groups} workgroups exceed {limit} per dimension")
        if all(g > 0 for g in groups):
            self.dispatches.append(Dispatch(pipeline, bind_group, groups, label or key.family))

    def __len__(self) -> int:
        return len(self.dispatches)


class Device:
    """Abstract device. Back ends implement the primitives; everything else is shared here."""

    limits: Limits
    adapter_name: str = "unknown"
    # The longest prefill chunk a session runs (None: the family's own, ``ChunkedSession.chunk``).
    # A page lowers it on a slow adapter, so that a chunk ends, and a Stop is read, within a
    # fraction of a second.
    prefill_chunk: int | None = None
    # True on CPU adapters (lavapipe, SwiftShader): kernels with a barrier-free variant use it.
    software_rasterizer: bool = False
    max_workgroups_per_dimension: int = 65535

    def __init__(self):
        self.counters = Counters()
        self._pipelines: dict = {}

    # -- primitives a back end provides -------------------------------------------------------
    def _create_buffer(self, size: int, usage: str, label: str):
        raise NotImplementedError

    def _write(self, handle, data, offset: int) -> None:
        raise NotImplementedError

    def _read(self, handle, offset: int, size: int) -> bytes:
        raise NotImplementedError

    def _create_pipeline(self, source: str, entry: str, label: str):
        raise NotImplementedError

    def _create_bind_group(self, pipeline, bindings: list):
        raise NotImplementedError

    def _encode_form(self, dispatches: list):
        """The dispatches as this back end encodes them fastest (built once per plan)."""
        return dispatches

    def _submit(self, encoded: list, copies: list) -> None:
        """One submit: a compute pass of every plan's encoded dispatches, then the copies."""
        raise NotImplementedError

    def _submit_steps(self, encoded, copies: list, readback=None):
        """One submit of len(copies) passes of one plan's encoded dispatches, pass i after copy i.
        ``readback`` (handle, offset, size): a back end that stages it inside this submit returns
        its handle for ``_collect_staged``; None leaves it to ``read``."""
        raise NotImplementedError

    def encoded(self, plan: Plan):
        """``plan``'s dispatches in the back end's encode form, made at its first run (a plan is
        complete once built; one that grew since is encoded again)."""
        form = plan.encoded
        if form is None or form[0] != len(plan.dispatches):
            form = plan.encoded = (len(plan.dispatches), self._encode_form(plan.dispatches))
        return form[1]

    def preamble(self) -> str:
        """Back-end specific WGSL directives (``enable`` lines) put before every source."""
        return ""

    def _destroy_buffer(self, handle) -> None:
        """Release a buffer's GPU memory now (work already submitted that uses it still runs)."""
        raise NotImplementedError

    def _submit_nothing(self) -> None:
        """An empty submit: the queue's pending writes go, and with them what they held."""
        raise NotImplementedError

    def _track_drop(self, buffer: Buffer):
        """What happens when Python drops ``buffer`` without ``free`` (a weakref.finalize)."""
        return weakref.finalize(buffer, _forget, self.counters, buffer.size)

    def wait_idle(self, what: str = "GPU work") -> None:
        """Block until the GPU has finished every submitted command (a real completion signal,
        not a validation sync), raising the first error it reported."""
        raise NotImplementedError

    def destroy(self) -> None:
        raise NotImplementedError

    # -- shared behaviour --------------------------------------------------------------------
    def buffer(self, size: int, *, label: str, usage: str = "storage", data=None, kind: str = "scratch") -> Buffer:
        """A zero-initialised buffer (``usage`` is "storage", "uniform" or "readback")."""
        size = max(16, (int(size) + 15) // 16 * 16)
        if size > self.limits.max_buffer:
            raise DeviceLimitError(f"{label}: {size} bytes exceeds the device's maxBufferSize {self.limits.max_buffer}")
        buffer = Buffer(self._create_buffer(size, usage, label), size, label, kind)
        self.counters.allocate(kind, size)
        self.counters.live_bytes += size
        buffer._dropped = self._track_drop(buffer)
        stack = getattr(_owners, "stack", None)
        if stack and kind not in UNOWNED_KINDS:
            stack[-1].append(buffer)
        if data is not None:
            self.write(buffer, data)
        return buffer

    def free(self, buffers) -> int:
        """Destroy ``buffers`` now (a closing session's own: no live plan may still bind them);
        weights, shared and already freed ones are skipped. Returns the bytes released."""
        released = 0
        for buffer in buffers:
            if buffer.freed or buffer.kind in UNOWNED_KINDS:
                continue
            buffer.freed = True
            buffer._dropped.detach()
            self.counters.live_bytes -= buffer.size
            released += buffer.size
            try:
                self._destroy_buffer(buffer.handle)
            except Exception:  # a lost device has released everything already
                pass
        if released:
            # wgpu-native and Dawn keep a destroyed buffer's memory while queue writes to it wait
            # for the next submit: a session that wrote its uniforms but never ran (a request with
            # no room) would leave all its memory behind until then. An empty submit lets it go.
            try:
                self._submit_nothing()
            except Exception:
                pass
        return released

    def write(self, buffer: Buffer, data, offset: int = 0) -> None:
        data = memoryview(data).cast("B")
        if len(data) % 4:
            data = memoryview(bytes(data) + b"\0" * (4 - len(data) % 4))
        if offset + len(data) > buffer.size:
            raise DeviceError(f"{buffer.label}: write of {len(data)} bytes at {offset} overflows {buffer.size}")
        self._write(buffer.handle, data, offset)
        self.counters.bytes_written += len(data)

    def read(self, buffer: Buffer, size: int | None = None, offset: int = 0) -> bytes:
        """Copy back ``size`` bytes (a multiple of 4) and wait for them."""
        size = buffer.size - offset if size is None else size
        cpu, wall = thread_clock(), time.perf_counter()
        data = self._read(buffer.handle, offset, size)
        counters = self.counters
        counters.read_cpu_s += thread_clock() - cpu
        counters.read_wall_s += time.perf_counter() - wall
        counters.bytes_read += size
        return data

    def pipeline(self, key: KernelKey):
        cached = self._pipelines.get(key)
        if cached is None:
            source = self.preamble() + key.header() + shader_source(key.family)
            cached = self._create_pipeline(source, key.entry, f"{key.family}.{key.entry}")
            self._pipelines[key] = cached
        return cached

    def bind_group(self, pipeline, bindings: list):
        resolved = []
        for b in bindings:
            if b is None:  # a binding number the entry point does not use
                resolved.append(None)
                continue
            b = b if isinstance(b, Binding) else Binding(b)
            size = b.buffer.size - b.offset if b.size is None else b.size
            if size > self.limits.max_storage_binding:
                raise DeviceLimitError(
                    f"{b.buffer.label}: binding of {size} bytes exceeds maxStorageBufferBindingSize "
                    f"{self.limits.max_storage_binding}")
            resolved.append(Binding(b.buffer, b.offset, size))
        return self._create_bind_group(pipeline, resolved)

    def run(self, *plans: Plan, copies: list = ()) -> None:
        """Record every dispatch of the plans into one pass and submit once."""
        cpu = thread_clock()
        self._submit([self.encoded(plan) for plan in plans], list(copies))
        counters = self.counters
        counters.encode_cpu_s += thread_clock() - cpu
        counters.dispatches += sum(len(plan.dispatches) for plan in plans)
        counters.submits += 1

    @property
    def round_tokens(self) -> int:
        """Decode steps per submit and readback when a request does not say
        (``generation.round_tokens``), by adapter kind (``ROUND_TOKENS``)."""
        return ROUND_TOKENS["software" if self.software_rasterizer else "hardware"]

    def run_steps(self, plan: Plan, records: Buffer, uniform: Buffer, count: int,
                  readback: tuple | None = None) -> "Pending | None":
        """``count`` runs of ``plan`` in one submit, run i after the 16-byte record i of
        ``records`` is copied into ``uniform`` (a multi-token decode round: each step at its own
        position, the records written beforehand with one ``write``).

        ``readback`` (buffer, offset, size): bytes the caller will want once the round is done;
        ``collect`` the returned ``Pending`` for them. A back end that can copies them inside
        the same submit and waits for that submit alone, so a round submitted after this one
        keeps the GPU busy while the host reads this one; elsewhere ``collect`` is a ``read``."""
        cpu = thread_clock()
        staged = self._submit_steps(self.encoded(plan),
                                    [(records.handle, 16 * i, uniform.handle, 0, 16) for i in range(count)],
                                    readback=None if readback is None else (readback[0].handle, *readback[1:]))
        counters = self.counters
        counters.encode_cpu_s += thread_clock() - cpu
        counters.dispatches += count * len(plan.dispatches)
        counters.submits += 1
        return None if readback is None else Pending(*readback, staged)

    def collect(self, pending: "Pending") -> bytes:
        """The bytes of a ``run_steps`` readback (counted as a ``read``)."""
        if pending.staged is None:
            return self.read(pending.buffer, pending.size, pending.offset)
        cpu, wall = thread_clock(), time.perf_counter()
        data = self._collect_staged(pending.staged, pending.size)
        counters = self.counters
        counters.read_cpu_s += thread_clock() - cpu
        counters.read_wall_s += time.perf_counter() - wall
        counters.bytes_read += pending.size
        return data

    def _collect_staged(self, staged, size: int) -> bytes:
        raise NotImplementedError

    @property
    def pipeline_count(self) -> int:
        return len(self._pipelines)
