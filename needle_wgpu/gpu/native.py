"""The desktop back end of the device layer, over wgpu-py (Vulkan, Metal, D3D12; lavapipe in CI)."""

from __future__ import annotations

from ..errors import DeviceError, DeviceLostError, OutOfMemoryError
from .device import Device, Limits

# Limits the model may use: take everything the adapter offers, up to these values.
WANTED_LIMITS = {
    "max-storage-buffer-binding-size": 1 << 30,
    "max-buffer-size": 1 << 31,
    "max-compute-workgroup-storage-size": 32768,
    "max-compute-invocations-per-workgroup": 256,
    "max-compute-workgroup-size-x": 256,
    "max-storage-buffers-per-shader-stage": 10,
}


def _raw_pass_calls():
    """wgpu-native's own compute-pass functions (set pipeline, set bind group, dispatch) and
    NULL, through wgpu-py's cffi binding; None where this wgpu-py does not expose them (the
    public methods are used then)."""
    try:
        from wgpu.backends.wgpu_native._api import ffi, lib

        return (lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
                lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL)
    except (ImportError, AttributeError):
        return None


_RAW = _raw_pass_calls()


def _raw_staging_calls():
    """wgpu-native's submit-for-index, poll-until-that-submission, map and mapped-range calls,
    and its cffi module: a round's readback waits for its own submit alone (wgpu-py's map waits
    by polling until every submitted command is done). None where this wgpu-py lacks them: a
    round's ids are then read after it like any other readback."""
    try:
        from wgpu.backends.wgpu_native._api import ffi, lib, libf

        return (libf.wgpuQueueSubmitForIndex, lib.wgpuDevicePoll, libf.wgpuBufferMapAsync,
                libf.wgpuBufferGetConstMappedRange, libf.wgpuBufferUnmap, ffi, lib)
    except (ImportError, AttributeError):
        return None


_STAGING = _raw_staging_calls()
MAX_POLLS = 1000  # a map that has not completed after this many waits is a device error


def _translate(exc: Exception, what: str) -> DeviceError:
    text = f"{what}: {exc}"
    lowered = text.lower()
    if "lost" in lowered or "destroyed" in lowered or "invalid device" in lowered:
        return DeviceLostError(text)
    if "out of memory" in lowered or "outofmemory" in lowered or "OutOfMemory" in type(exc).__name__:
        return OutOfMemoryError(text)
    return DeviceError(text)


class NativeDevice(Device):
    """wgpu-py device. ``max_storage_binding`` lowers the binding limit (to test tensor splitting)."""

    def __init__(self, max_storage_binding: int | None = None, power_preference: str = "high-performance"):
        super().__init__()
        try:
            import wgpu
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise DeviceError(f"wgpu-py is not installed ({exc}); pip install wgpu") from None
        self._wgpu = wgpu
        try:
            adapter = wgpu.gpu.request_adapter_sync(power_preference=power_preference)
        except Exception as exc:
            raise DeviceError(f"no WebGPU adapter: {exc}") from None
        if adapter is None:
            raise DeviceError("no WebGPU adapter (on Linux without a GPU, install mesa-vulkan-drivers)")
        offered = adapter.limits
        wanted = {k: min(v, offered[k]) for k, v in WANTED_LIMITS.items() if k in offered}
        try:
            self._device = adapter.request_device_sync(required_limits=wanted)
        except Exception as exc:
            raise _translate(exc, "request_device") from None
        info = adapter.info
        self.software_rasterizer = str(info.get("adapter_type", "")).lower() == "cpu"
        self.adapter_name = f"{info.get('device', '?')} ({info.get('backend_type', '?')}, {info.get('adapter_type', '?')})"
        lim = self._device.limits
        binding = lim["max-storage-buffer-binding-size"]
        if max_storage_binding is not None:
            binding = min(binding, max_storage_binding)
        self.limits = Limits(
            max_storage_binding=binding,
            max_buffer=lim["max-buffer-size"],
            max_workgroup_storage=lim["max-compute-workgroup-storage-size"],
            max_invocations=lim["max-compute-invocations-per-workgroup"],
            max_storage_buffers=lim["max-storage-buffers-per-shader-stage"],
        )
        self.max_workgroups_per_dimension = lim["max-compute-workgroups-per-dimension"]
        self._usage = {
            "storage": wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC,
            "uniform": wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST,
            "readback": wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
        }
        self.lost = False
        self._fence = None  # 16 bytes read back by wait_idle
        self._stagings = []  # mappable buffers of collected rounds, free for the next (``_take_staging``)
        self._map_callback = self._map_done = None  # a round readback's map callback and its statuses

    def _guard(self, what):
        if self.lost:
            raise DeviceLostError(f"{what}: the GPU device was lost or destroyed; "
                                  "open a new device and load the model again")

    def _failed(self, exc: Exception, what: str) -> DeviceError:
        """The NeedleError for a wgpu exception; after a loss every later call fails fast."""
        error = _translate(exc, what)
        if isinstance(error, DeviceLostError):
            self.lost = True
        return error

    def _create_buffer(self, size, usage, label):
        self._guard(label)
        try:
            return self._device.create_buffer(size=size, usage=self._usage[usage], label=label)
        except Exception as exc:
            raise self._failed(exc, f"allocating {label} ({size} bytes)") from None

    def _write(self, handle, data, offset):
        self._guard("write")
        try:
            self._device.queue.write_buffer(handle, offset, data)
        except Exception as exc:
            raise self._failed(exc, "writing") from None

    def _read(self, handle, offset, size):
        self._guard("read")
        try:
            return bytes(self._device.queue.read_buffer(handle, offset, size))
        except Exception as exc:
            raise self._failed(exc, "reading back") from None

    def _destroy_buffer(self, handle):
        handle.destroy()

    def _submit_nothing(self):
        if not self.lost:  # wgpu-native aborts the process on a submit to a destroyed device
            self._device.queue.submit([])

    def wait_idle(self, what="GPU work"):
        """A 4-byte readback: it completes after every command submitted before it (wgpu-py
        0.32's ``on_submitted_work_done_sync`` has a binding bug)."""
        if self._fence is None:
            self._fence = self._create_buffer(16, "storage", "fence")
        self._read(self._fence, 0, 4)

    def _create_pipeline(self, source, entry, label):
        self._guard(label)
        try:
            module = self._device.create_shader_module(code=source, label=label)
            return self._device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": entry}, label=label)
        except Exception as exc:
            raise self._failed(exc, f"compiling {label}") from None

    def _create_bind_group(self, pipeline, bindings):
        self._guard("bind group")
        entries = [{"binding": i, "resource": {"buffer": b.buffer.handle, "offset": b.offset, "size": b.size}}
                   for i, b in enumerate(bindings) if b is not None]  # None: a binding the entry does not use
        try:
            layout = pipeline.get_bind_group_layout(0)
            return self._device.create_bind_group(layout=layout, entries=entries)
        except Exception as exc:
            raise self._failed(exc, "creating a bind group") from None

    def _encode_form(self, dispatches):
        """(pipeline, bind group, x, y, z) with wgpu-native's own handles where wgpu-py exposes
        them: a pass is then recorded by direct calls, about 1 us a dispatch instead of the
        public methods' 4-5 us (argument checks, error capture per call). An encoding error
        still surfaces: wgpu-native reports it when the command buffer is finished or submitted,
        which go through the public, checked calls. The Plan keeps the Python objects alive."""
        if _RAW is None:
            return [(d.pipeline, d.bind_group, *d.groups) for d in dispatches]
        return [(d.pipeline._internal, d.bind_group._internal, *d.groups) for d in dispatches]

    def _record(self, encoder, encoded) -> None:
        compute = encoder.begin_compute_pass()
        if _RAW is None:
            for pipeline, bind_group, x, y, z in encoded:
                compute.set_pipeline(pipeline)
                compute.set_bind_group(0, bind_group)
                compute.dispatch_workgroups(x, y, z)
        else:
            raw, set_pipeline, set_bind_group, dispatch, null = compute._internal, *_RAW
            for pipeline, bind_group, x, y, z in encoded:
                set_pipeline(raw, pipeline)
                set_bind_group(raw, 0, bind_group, 0, null)
                dispatch(raw, x, y, z)
        compute.end()

    def _submit(self, encoded, copies):
        self._guard("submit")
        try:
            encoder = self._device.create_command_encoder()
            if any(encoded):
                self._record(encoder, [d for plan in encoded for d in plan] if len(encoded) > 1 else encoded[0])
            for source, src_offset, target, dst_offset, size in copies:
                encoder.copy_buffer_to_buffer(source.handle, src_offset, target.handle, dst_offset, size)
            self._device.queue.submit([encoder.finish()])
        except Exception as exc:
            raise self._failed(exc, "submitting work") from None

    def _submit_steps(self, encoded, copies, readback=None):
        self._guard("submit")
        staging = None
        try:
            encoder = self._device.create_command_encoder()
            for source, src_offset, target, dst_offset, size in copies:
                encoder.copy_buffer_to_buffer(source, src_offset, target, dst_offset, size)
                self._record(encoder, encoded)
            if readback is None or _STAGING is None:
                self._device.queue.submit([encoder.finish()])
                return None
            source, offset, size = readback
            staging = self._take_staging(size)
            encoder.copy_buffer_to_buffer(source, offset, staging, 0, size)
            submit_for_index, ffi = _STAGING[0], _STAGING[5]
            commands = encoder.finish()
            index = submit_for_index(self._device.queue._internal, 1, ffi.new("WGPUCommandBuffer[1]", [commands._internal]))
            return staging, index
        except Exception as exc:
            raise self._failed(exc, "submitting work") from None

    def _take_staging(self, size: int):
        """A mappable buffer of at least ``size`` bytes that no uncollected round uses (a
        discarded round's is dropped with it: reusing it could map a later copy's bytes)."""
        for i, buffer in enumerate(self._stagings):
            if buffer.size >= size:
                return self._stagings.pop(i)
        return self._create_buffer(max(256, 1 << (size - 1).bit_length()), "readback", "round readback")

    def _collect_staged(self, staged, size):
        self._guard("read")
        staging, index = staged
        _, poll, map_async, mapped_range, unmap, ffi, lib = _STAGING
        if self._map_callback is None:  # made once: a cffi callback is costly to make per round
            done = self._map_done = []

            @ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
            def mapped(status, message, userdata1, userdata2):
                done.append(status)

            self._map_callback = (mapped, ffi.new("WGPUBufferMapCallbackInfo *", {
                "mode": lib.WGPUCallbackMode_AllowProcessEvents, "callback": mapped}))
        done, info = self._map_done, self._map_callback[1]
        done.clear()
        try:
            map_async(staging._internal, lib.WGPUMapMode_Read, 0, size, info[0])
            submission = ffi.new("WGPUSubmissionIndex *", index)
            for _ in range(MAX_POLLS):  # the first wait ends with the submit; the map's callback runs in it
                poll(self._device._internal, True, submission)
                if done:
                    break
            if done != [lib.WGPUMapAsyncStatus_Success]:
                raise DeviceError(f"mapping a round's readback failed (status {done or 'none'})")
            data = bytes(ffi.buffer(mapped_range(staging._internal, 0, size), size))
            unmap(staging._internal)
        except Exception as exc:
            raise self._failed(exc, "reading back") from None
        self._stagings.append(staging)
        return data

    def destroy(self) -> None:
        """Destroy the device (also how tests simulate a device loss)."""
        if not self.lost:
            self.lost = True
            try:
                self._device.destroy()
            except Exception:
                pass
