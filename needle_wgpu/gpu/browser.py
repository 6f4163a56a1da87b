"""The browser back end of the device layer: Pyodide's JS FFI over ``navigator.gpu``.

The model code is the same as on the desktop and synchronous; the WebGPU API in a browser is
not. Two rules make that work:

* Opening a device is async (``requestAdapter``/``requestDevice``): ``await
  create_browser_device()`` from ``runPythonAsync`` or an async Python function.
* Reading back (``Device.read``) and compiling a pipeline block on a JS promise with
  ``pyodide.ffi.run_sync``, which needs JS Promise Integration (JSPI, Chromium 137+). The
  **outermost** Python call must come from ``pyodide.runPythonAsync``, an async Python function
  or ``PyCallable.callPromising``; from plain ``runPython`` the read raises ``DeviceError``
  ("Cannot stack switch"). Browsers without JSPI (Firefox, Safari today) get a clear
  ``DeviceError`` when the device is opened.

Validation, out-of-memory and internal errors are captured by error scopes that stay open
between sync points; they are popped at every readback (and around each pipeline), so an error
surfaces as a ``DeviceError`` at the next read, as it does natively. A lost device raises
``DeviceLostError`` on the next call. No numpy: bytes move as memoryviews and JS typed arrays.
"""

from __future__ import annotations

import gc
import weakref

from ..errors import DeviceError, DeviceLostError, OutOfMemoryError
from .device import Device, Limits

# What the model may use: each is raised up to the adapter's value (browsers hand out the spec
# defaults unless asked: 128 MiB binding, 256 MiB buffer, 16 KiB workgroup storage, 8 buffers).
WANTED_LIMITS = {
    "maxStorageBufferBindingSize": 1 << 30,
    "maxBufferSize": 1 << 31,
    "maxComputeWorkgroupStorageSize": 32768,
    "maxStorageBuffersPerShaderStage": 10,
    "maxComputeInvocationsPerWorkgroup": 256,
    "maxComputeWorkgroupSizeX": 256,
}

# What the kernels cannot run without (shaders/*.wgsl): 256-thread workgroups and seven storage
# buffers in one kernel (mhc_mix). Core WebGPU guarantees these; reduced adapters (compatibility
# mode) may not, and are refused with a message instead of failing at the first pipeline.
NEEDED_LIMITS = {
    "maxComputeInvocationsPerWorkgroup": 256,
    "maxComputeWorkgroupSizeX": 256,
    "maxStorageBuffersPerShaderStage": 7,
}

ERROR_FILTERS = ("validation", "out-of-memory", "internal")

# One JS call per upload: the Python buffer is exposed to JS as a view of the WebAssembly heap
# (PyProxy.getBuffer), so the bytes go from Python memory to the GPU queue without a copy.
_WRITE_FROM_PYTHON = """
const view = source.getBuffer("u8");
try { queue.writeBuffer(buffer, offset, view.data); } finally { view.release(); }
"""


# One JS call per submit: the passes are recorded by this function from arrays built once per
# plan (``_encode_form``), so a decode step crosses from Python into JS once, not three times a
# dispatch. ``steps`` passes of the plans; with ``records``, pass s follows a copy of the 16-byte
# record s into ``uniform`` (a multi-token round); then the copies, then one submit.
_RUN_PASSES = """
const encoder = device.createCommandEncoder();
for (let s = 0; s < steps; s++) {
  if (records) encoder.copyBufferToBuffer(records, 16 * s, uniform, 0, 16);
  const pass = encoder.beginComputePass();
  for (const plan of plans) {
    const pipelines = plan.pipelines, groups = plan.groups, counts = plan.counts;
    for (let i = 0; i < pipelines.length; i++) {
      pass.setPipeline(pipelines[i]);
      pass.setBindGroup(0, groups[i]);
      pass.dispatchWorkgroups(counts[3 * i], counts[3 * i + 1], counts[3 * i + 2]);
    }
  }
  pass.end();
}
for (const c of copies) encoder.copyBufferToBuffer(c[0], c[1], c[2], c[3], c[4]);
device.queue.submit([encoder.finish()]);
"""


def _js():
    try:
        import js
        from pyodide.ffi import to_js
    except ImportError:  # pragma: no cover - only on the desktop
        raise DeviceError("the browser back end needs Pyodide (use open_device('native') on the desktop)") from None
    return js, to_js


def _absent(value) -> bool:
    """JS null arrives as ``pyodide.ffi.jsnull`` (undefined as None): both mean "nothing"."""
    return value is None or type(value).__name__ == "JsNull"


def _message(exc) -> str:
    """The text of a JS exception (or rejection reason) without Pyodide's traceback."""
    text = getattr(exc, "message", None) or str(exc)
    return str(text).strip().splitlines()[0] if str(text).strip() else type(exc).__name__


def _translate(exc, what: str) -> DeviceError:
    text = f"{what}: {_message(exc)}"
    lowered = text.lower()
    if "cannot stack switch" in lowered or "run_sync" in lowered:
        return DeviceError(f"{what}: a GPU readback must run inside runPythonAsync/callPromising (JSPI); "
                           f"it was called from synchronous runPython ({_message(exc)})")
    if "lost" in lowered or "destroyed" in lowered:
        return DeviceLostError(text)
    if "out of memory" in lowered or "outofmemory" in lowered:
        return OutOfMemoryError(text)
    return DeviceError(text)


async def create_browser_device(power_preference: str = "high-performance",
                                max_storage_binding: int | None = None) -> "BrowserDevice":
    """Open a WebGPU device through ``navigator.gpu`` with the limits the model needs.

    Raises ``DeviceError`` when the browser has no WebGPU (or no adapter), lacks JSPI, or the
    adapter cannot give a limit in ``NEEDED_LIMITS``.
    """
    gpu_device, adapter_info = await _request_device(power_preference)
    return BrowserDevice(gpu_device, adapter_info=adapter_info, max_storage_binding=max_storage_binding)


async def _request_device(power_preference: str) -> tuple:
    js, to_js = _js()
    from pyodide.ffi import can_run_sync

    gpu = getattr(js.navigator, "gpu", None)
    if gpu is None:
        raise DeviceError("this browser has no WebGPU (navigator.gpu is missing): use a recent Chrome or Edge, "
                          "or enable WebGPU in the browser's settings")
    if not can_run_sync():
        raise DeviceError("this browser lacks JavaScript Promise Integration (JSPI), which the engine needs "
                          "to wait for the GPU: use Chrome or Edge 137 or newer")
    try:
        # An adapter is single-use in Chromium: ask for a fresh one for every device.
        adapter = await gpu.requestAdapter(to_js({"powerPreference": power_preference},
                                                 dict_converter=js.Object.fromEntries))
    except Exception as exc:
        raise _translate(exc, "requestAdapter") from None
    if _absent(adapter):
        raise DeviceError("WebGPU is present but no GPU adapter is available (it may be blocked or disabled "
                          "in this browser; see chrome://gpu)")
    offered = adapter.limits
    for name, needed in NEEDED_LIMITS.items():
        have = int(getattr(offered, name))
        if have < needed:
            raise DeviceError(f"the GPU adapter offers {name} = {have}; the model needs at least {needed}")
    required = {name: min(int(value), int(getattr(offered, name))) for name, value in WANTED_LIMITS.items()}
    descriptor = to_js({"requiredLimits": required, "label": "needle-wgpu"}, dict_converter=js.Object.fromEntries)
    try:
        device = await adapter.requestDevice(descriptor)
    except Exception as exc:
        raise _translate(exc, "requestDevice") from None
    return device, adapter.info


def is_software_adapter(adapter_info) -> bool:
    """A CPU rasterizer behind WebGPU (Chromium's SwiftShader, or an adapter that says it is a
    fallback): kernels then take their CPU shape (spec dense-gguf §8)."""
    architecture = str(getattr(adapter_info, "architecture", "") or "").lower()
    description = str(getattr(adapter_info, "description", "") or "").lower()
    fallback = getattr(adapter_info, "isFallbackAdapter", False) is True
    return fallback or any(name in text for name in ("swiftshader", "llvmpipe", "lavapipe")
                           for text in (architecture, description))


class BrowserDevice(Device):
    """A ``GPUDevice`` seen through Pyodide.

    Build it with ``await create_browser_device()``; ``BrowserDevice()`` without a device (what
    ``open_device("browser")`` does) opens one by blocking with JSPI, so it too must run under
    ``runPythonAsync``/``callPromising``.
    """

    def __init__(self, gpu_device=None, adapter_info=None, max_storage_binding: int | None = None,
                 power_preference: str = "high-performance"):
        super().__init__()
        js, to_js = _js()
        from pyodide.ffi import can_run_sync, create_once_callable, run_sync

        if gpu_device is None:
            if not can_run_sync():
                raise DeviceError("opening a browser device needs JSPI from here: call "
                                  "`await create_browser_device()` instead (or use Chrome/Edge 137+)")
            gpu_device, adapter_info = run_sync(_request_device(power_preference))

        self._js, self._to_js, self._run_sync = js, to_js, run_sync
        self._device = gpu_device
        self._queue = gpu_device.queue
        self.lost_reason: str | None = None
        self.on_pipeline = None  # optional callback(count, label) for progress reports
        gpu_device.lost.then(create_once_callable(self._on_lost))
        if adapter_info is not None:
            parts = [str(getattr(adapter_info, k, "") or "") for k in ("vendor", "architecture", "description")]
            self.adapter_name = " ".join(p for p in parts if p) or "WebGPU adapter"
            self.software_rasterizer = is_software_adapter(adapter_info)
        lim = gpu_device.limits
        binding = int(lim.maxStorageBufferBindingSize)
        if max_storage_binding is not None:
            binding = min(binding, int(max_storage_binding))
        self.limits = Limits(
            max_storage_binding=binding,
            max_buffer=int(lim.maxBufferSize),
            max_workgroup_storage=int(lim.maxComputeWorkgroupStorageSize),
            max_invocations=int(lim.maxComputeInvocationsPerWorkgroup),
            max_storage_buffers=int(lim.maxStorageBuffersPerShaderStage),
        )
        self.max_workgroups_per_dimension = int(lim.maxComputeWorkgroupsPerDimension)
        usage, self._map_read = js.GPUBufferUsage, js.GPUMapMode.READ
        self._usage = {
            "storage": usage.STORAGE | usage.COPY_DST | usage.COPY_SRC,
            "uniform": usage.UNIFORM | usage.COPY_DST,
            "readback": usage.MAP_READ | usage.COPY_DST,
        }
        self._staging_usage = usage.MAP_READ | usage.COPY_DST
        self._staging = None
        self._staging_size = 0
        self._round_stagings = []  # round readbacks collected and free for the next round
        self._dropped = []  # JS WeakRefs to the handles of Buffers Python has dropped
        try:
            self._write_from_python = js.Function.new("queue", "buffer", "offset", "source", _WRITE_FROM_PYTHON)
            self._run_passes = js.Function.new("device", "plans", "steps", "records", "uniform", "copies",
                                               _RUN_PASSES)
        except Exception:  # a Content-Security-Policy without 'unsafe-eval': copy through a typed array
            self._write_from_python = self._run_passes = None
        self._open_scopes()

    # -- helpers -----------------------------------------------------------------------------
    def _object(self, value):
        return self._to_js(value, dict_converter=self._js.Object.fromEntries)

    def _on_lost(self, info):
        message = str(getattr(info, "message", "") or "")
        reason = str(getattr(info, "reason", "") or "unknown")
        self.lost_reason = f"{reason}{': ' + message if message else ''}"

    def _guard(self, what: str) -> None:
        if self.lost_reason is not None:
            raise DeviceLostError(f"{what}: the GPU device was lost ({self.lost_reason}); load the model again")

    def _wait(self, promise, what: str):
        try:
            return self._run_sync(promise)
        except Exception as exc:
            if self.lost_reason is not None:
                raise DeviceLostError(f"{what}: the GPU device was lost ({self.lost_reason})") from None
            raise _translate(exc, what) from None

    def _open_scopes(self) -> None:
        for name in ERROR_FILTERS:
            self._device.pushErrorScope(name)

    def _sync(self, what: str, promise=None):
        """Wait for the GPU: pop the open error scopes (and ``promise``, if any) in one JSPI wait.

        Raises the first error a scope caught, then ``promise``'s rejection; returns its value.
        """
        self._guard(what)
        js = self._js
        pending = [self._device.popErrorScope() for _ in ERROR_FILTERS]
        self._open_scopes()
        if promise is not None:
            pending.append(promise)
        outcomes = self._wait(js.Promise.allSettled(self._to_js(pending)), what)
        self._guard(what)
        results = [(o.status == "fulfilled", o.value if o.status == "fulfilled" else o.reason) for o in outcomes]
        for ok, error in results[: len(ERROR_FILTERS)]:
            if not ok:
                raise _translate(error, what)
            if not _absent(error):
                text = f"{what}: {_message(error)}"
                if str(getattr(getattr(error, "constructor", None), "name", "")) == "GPUOutOfMemoryError":
                    raise OutOfMemoryError(text)
                raise DeviceError(text)
        if promise is not None:
            ok, value = results[-1]
            if not ok:
                raise _translate(value, what)
            return value
        return None

    def check(self, what: str = "GPU work") -> None:
        """Wait for the GPU and raise the first validation, out-of-memory or internal error."""
        self._sync(what)

    # -- primitives --------------------------------------------------------------------------
    def _create_buffer(self, size, usage, label):
        self._guard(label)
        try:
            descriptor = self._object({"size": size, "usage": self._usage[usage], "label": label})
            handle = self._device.createBuffer(descriptor)
        except Exception as exc:
            raise _translate(exc, f"allocating {label} ({size} bytes)") from None
        return handle

    def _track_drop(self, buffer):
        # When Python drops the Buffer, remember its handle weakly: its GPU memory stays until
        # release_dropped (or some later JS garbage collection), and counts as live until then.
        return weakref.finalize(buffer, self._dropped.append, (self._js.WeakRef.new(buffer.handle), buffer.size))

    def _destroy_buffer(self, handle):
        handle.destroy()

    def _submit_nothing(self):
        if not self.lost_reason:
            self._device.queue.submit(self._js.Array.new())

    def release_dropped(self) -> int:
        """Destroy the GPU memory of buffers Python no longer references, now rather than at some
        later JS garbage collection; returns how many. Only safe where no live bind group refers
        to them: call it after dropping a model and its sessions, before loading the next."""
        gc.collect()
        released = 0
        for ref, size in self._dropped:
            self.counters.live_bytes -= size
            handle = ref.deref()
            if not _absent(handle):
                handle.destroy()
                released += 1
        self._dropped.clear()
        return released

    def wait_idle(self, what: str = "GPU work") -> None:
        """Wait for ``queue.onSubmittedWorkDone()`` (every submitted command has run) and the
        error scopes, in one JSPI wait."""
        self._sync(what, self._queue.onSubmittedWorkDone())

    def _write(self, handle, data, offset):
        self._guard("write")
        try:
            if self._write_from_python is not None:
                self._write_from_python(self._queue, handle, offset, data)
            else:
                staged = self._js.Uint8Array.new(len(data))
                staged.assign(data)
                self._queue.writeBuffer(handle, offset, staged)
        except Exception as exc:
            raise _translate(exc, "writing to the GPU") from None

    def _read(self, handle, offset, size):
        self._guard("read")
        if size % 4 or offset % 4:
            raise DeviceError(f"read of {size} bytes at {offset}: both must be multiples of 4")
        if size > self._staging_size:
            if self._staging is not None:
                self._staging.destroy()
            self._staging_size = max(256, 1 << (size - 1).bit_length())
            self._staging = self._device.createBuffer(self._object(
                {"size": self._staging_size, "usage": self._staging_usage, "label": "staging"}))
        try:
            encoder = self._device.createCommandEncoder()
            encoder.copyBufferToBuffer(handle, offset, self._staging, 0, size)
            self._queue.submit([encoder.finish()])
        except Exception as exc:
            raise _translate(exc, "reading back") from None
        try:
            self._sync("reading back", self._staging.mapAsync(self._map_read, 0, size))
            return self._staging.getMappedRange(0, size).to_bytes()
        finally:
            if str(self._staging.mapState) != "unmapped":
                try:
                    self._staging.unmap()
                except Exception:  # the device went away mid-read; _guard reports it next
                    pass

    def _create_pipeline(self, source, entry, label):
        self._guard(label)
        module = self._device.createShaderModule(self._object({"code": source, "label": label}))
        descriptor = self._object({"layout": "auto", "label": label,
                                   "compute": {"module": module, "entryPoint": entry}})
        try:
            pipeline = self._sync(f"compiling {label}", self._device.createComputePipelineAsync(descriptor))
        except DeviceLostError:
            raise
        except DeviceError as exc:
            raise DeviceError(f"{exc}{self._compilation_messages(module)}") from None
        if self.on_pipeline is not None:
            self.on_pipeline(len(self._pipelines) + 1, label)
        return pipeline

    def _compilation_messages(self, module) -> str:
        try:
            info = self._run_sync(module.getCompilationInfo())
            lines = [f"\n  line {m.lineNum}:{m.linePos} {m.type}: {m.message}" for m in info.messages]
        except Exception:
            return ""
        return "".join(lines[:8])

    def _create_bind_group(self, pipeline, bindings):
        self._guard("bind group")
        layout = pipeline.getBindGroupLayout(0)
        entries = [{"binding": i, "resource": {"buffer": b.buffer.handle, "offset": b.offset, "size": b.size}}
                   for i, b in enumerate(bindings) if b is not None]  # None: a binding the entry does not use
        try:
            return self._device.createBindGroup(self._object({"layout": layout, "entries": entries}))
        except Exception as exc:
            raise _translate(exc, "creating a bind group") from None

    def _encode_form(self, dispatches):
        """The plan as JS arrays (pipelines, bind groups, workgroup counts), built once: what
        ``_RUN_PASSES`` records a pass from; and the dispatches themselves, for a page whose
        Content-Security-Policy forbids making that function (then each call crosses)."""
        js, to_js = self._js, self._to_js
        plan = js.Object.new()
        plan.pipelines = to_js([d.pipeline for d in dispatches])
        plan.groups = to_js([d.bind_group for d in dispatches])
        plan.counts = js.Uint32Array.new(to_js([n for d in dispatches for n in d.groups]))
        return plan, dispatches

    def _passes(self, encoded, steps: int, records, uniform, copies) -> None:
        if self._run_passes is not None:
            self._run_passes(self._device, self._to_js([plan for plan, _ in encoded]), steps, records, uniform,
                             self._to_js([list(c) for c in copies]))
            return
        encoder = self._device.createCommandEncoder()
        for step in range(steps):
            if records is not None:
                encoder.copyBufferToBuffer(records, 16 * step, uniform, 0, 16)
            compute = encoder.beginComputePass()
            for _, dispatches in encoded:
                for d in dispatches:
                    compute.setPipeline(d.pipeline)
                    compute.setBindGroup(0, d.bind_group)
                    compute.dispatchWorkgroups(*d.groups)
            compute.end()
        for copy in copies:
            encoder.copyBufferToBuffer(*copy)
        self._queue.submit([encoder.finish()])

    def _submit(self, encoded, copies):
        self._guard("submit")
        steps = 1 if any(dispatches for _, dispatches in encoded) else 0
        try:
            self._passes(encoded, steps, None, None, [(s.handle, so, t.handle, to, n) for s, so, t, to, n in copies])
        except Exception as exc:
            raise _translate(exc, "submitting work") from None

    def _submit_steps(self, encoded, copies, readback=None):
        """A round's passes in one submit; its ``readback`` is copied into a staging buffer of its
        own inside that submit, so that mapping it waits for this round alone (Dawn waits for the
        last submit that used a buffer), not for a round submitted after it."""
        self._guard("submit")
        records, _, uniform, _, _ = copies[0]
        staging = None if readback is None else self._take_staging(readback[2])
        try:
            self._passes([encoded], len(copies), records, uniform,
                         [] if staging is None else [(readback[0], readback[1], staging, 0, readback[2])])
        except Exception as exc:
            raise _translate(exc, "submitting work") from None
        return staging

    def _take_staging(self, size: int):
        """A mappable buffer of at least ``size`` bytes that no uncollected round uses (a
        discarded round's is dropped with it: reusing it could map a later copy's bytes)."""
        for i, buffer in enumerate(self._round_stagings):
            if int(buffer.size) >= size:
                return self._round_stagings.pop(i)
        try:
            return self._device.createBuffer(self._object({"size": max(256, 1 << (size - 1).bit_length()),
                                                           "usage": self._staging_usage, "label": "round readback"}))
        except Exception as exc:
            raise _translate(exc, "creating a round's readback") from None

    def _collect_staged(self, staging, size):
        self._guard("read")
        try:
            self._sync("reading back", staging.mapAsync(self._map_read, 0, size))
            data = staging.getMappedRange(0, size).to_bytes()
        finally:
            if str(staging.mapState) != "unmapped":
                try:
                    staging.unmap()
                except Exception:  # the device went away mid-read; _guard reports it next
                    pass
        self._round_stagings.append(staging)
        return data

    def destroy(self) -> None:
        """Destroy the GPUDevice (also how tests simulate a device loss)."""
        if self.lost_reason is None:
            self.lost_reason = "destroyed"
        try:
            self._device.destroy()
        except Exception:
            pass
