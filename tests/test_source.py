"""Model sources (formats/source.py): paths that are not regular files never block or read
forever, huge files are read only as far as their header says, released buffers are typed errors.
"""

import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from needle_wgpu.errors import ContainerError
from needle_wgpu.formats import cact
from needle_wgpu.formats.source import Source, read_source
from needle_wgpu.synth import synthesize

ROOT = Path(__file__).resolve().parents[1]
VALID = synthesize("tiny", seed=0)
SPARSE_SIZE = 16 << 30
RECORD_AT = 196 + 4 * 28


def _load_in_subprocess(path: str, timeout: float = 20.0) -> subprocess.CompletedProcess:
    """cact.load in a child process, so a reader that blocks fails the test instead of hanging it."""
    code = ("import sys\nfrom needle_wgpu.formats import cact\nfrom needle_wgpu.errors import ContainerError\n"
            "try:\n    cact.load(sys.argv[1])\nexcept ContainerError as exc:\n    print('ContainerError:', exc)\n")
    return subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.cact"
    os.mkfifo(fifo)
    done = _load_in_subprocess(str(fifo))
    assert done.returncode == 0, done.stderr
    assert "ContainerError:" in done.stdout and "not a regular file: a FIFO" in done.stdout


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a character device"), ("/dev/null", "a character device")])
def test_a_device_is_refused_before_any_read(path, kind):
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    with pytest.raises(ContainerError, match=f"file {path}: cannot read \\(not a regular file: {kind}\\)"):
        cact.load(path)


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(ContainerError, match="not a regular file: a directory"):
        cact.load(tmp_path)


def _sparse(tmp_path, prefix: bytes) -> Path:
    path = tmp_path / "sparse.cact"
    with open(path, "wb") as f:
        f.write(prefix)
        f.truncate(SPARSE_SIZE)
    return path


def _peak_while(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_huge_sparse_file_of_zeros_is_refused_after_its_tag(tmp_path):
    path = _sparse(tmp_path, b"")
    with pytest.raises(ContainerError, match="header: wrong tag 0x00000000") as caught:
        _peak_while(lambda: cact.load(path))
    _, peak = _peak_while(lambda: pytest.raises(ContainerError, cact.load, path))
    assert peak < 64 * 1024, caught.value


def test_a_valid_model_followed_by_a_huge_sparse_tail_reads_only_the_model(tmp_path):
    path = _sparse(tmp_path, VALID)
    loaded, peak = _peak_while(lambda: cact.load(path))
    assert loaded.file_size == len(VALID)
    assert bytes(loaded["final_norm"].data) == bytes(cact.load(VALID)["final_norm"].data)
    assert peak < 2 * len(VALID)


def test_a_record_claiming_the_end_of_a_huge_file_is_refused_before_the_blobs_are_read(tmp_path):
    out = bytearray(VALID)
    last = struct.unpack_from("<I", VALID, 4)[0] - 1
    offset_at = RECORD_AT + 44 * last + 20  # the u64 offset of the tokenizer record
    struct.pack_into("<Q", out, offset_at, SPARSE_SIZE - (1 << 20))
    path = _sparse(tmp_path, bytes(out))
    with pytest.raises(ContainerError, match=f"record {last}: blob ends at"):
        cact.load(path)
    _, peak = _peak_while(lambda: pytest.raises(ContainerError, cact.load, path))
    assert peak < 64 * 1024


def test_a_truncated_file_is_reported_as_truncated(tmp_path):
    path = tmp_path / "short.cact"
    path.write_bytes(VALID[:1000])
    with pytest.raises(ContainerError, match="directory: truncated"):
        cact.load(path)
    path.write_bytes(VALID[:-10])
    with pytest.raises(ContainerError, match="runs past the end of the file"):
        cact.load(path)


def test_a_path_and_its_bytes_load_the_same(tmp_path):
    path = tmp_path / "model.cact"
    path.write_bytes(VALID)
    from_path, from_bytes = cact.load(path), cact.load(VALID)
    assert from_path.file_size == from_bytes.file_size == len(VALID)
    assert all(bytes(t.data) == bytes(from_bytes[name].data) for name, t in from_path.tensors.items())
    assert bytes(from_path.tokenizer) == bytes(from_bytes.tokenizer)


def test_a_released_memoryview_is_a_container_error():
    view = memoryview(bytearray(VALID))
    view.release()
    with pytest.raises(ContainerError, match="released"):
        cact.load(view)


def test_read_source_asks_again_until_the_format_is_satisfied(tmp_path):
    """The general API the GGUF reader uses: first bytes, then as many as ``needed`` says."""
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    calls = []

    def needed(view, size):
        calls.append((len(view), size))
        return 100 if len(view) < 100 else 5000

    data = read_source(path, needed, first=8)
    assert calls == [(8, 16384), (100, 16384), (5000, 16384)]
    assert bytes(data) == (bytes(range(256)) * 64)[:5000]
    with Source(path) as src:
        assert bytes(src.prefix(3)) == b"\x00\x01\x02" and bytes(src.prefix(1 << 40))[-1] == 255
    # Bytes are used in place and whole; needed is not consulted.
    assert bytes(read_source(b"abc", lambda view, size: 1 / 0, first=1)) == b"abc"
