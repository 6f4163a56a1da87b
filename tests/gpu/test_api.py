"""The family-neutral surface: needle_wgpu.load tells the family by magic, and Model's
encode/decode/describe agree with the family's own pieces."""

import pytest

import needle_wgpu
from needle_wgpu import families
from needle_wgpu.api import Model
from needle_wgpu.engine import Needle3
from needle_wgpu.errors import ContainerError, InputError, UnsupportedModelError
from needle_wgpu.formats import cact
from needle_wgpu.synth import synthesize

pytestmark = pytest.mark.gpu

TINY = synthesize("tiny", 0)


def test_load_is_one_entry_for_paths_and_bytes(tmp_path, device):
    path = tmp_path / "model.bin"  # the name says nothing: the magic decides
    path.write_bytes(TINY)
    by_path = needle_wgpu.load(str(path), device=device)
    by_bytes = needle_wgpu.load(memoryview(TINY), device=device)
    assert isinstance(by_path, Model) and Needle3 is Model
    assert by_path.logits([2, 17, 5]) == by_bytes.logits([2, 17, 5])
    assert by_path.describe()["family"] == "needle3"
    assert by_path.describe()["gpu_weight_bytes"] > 0


def test_encode_decode_round_trip(device):
    model = needle_wgpu.load(TINY, device=device)
    ids = model.encode("turn off the lights")
    assert ids and model.decode(ids) == "turn off the lights"
    assert model.encode_request("hi") == [model.tokenizer.bos_id] + model.encode("hi")
    last = model.geometry.vocab - 1
    assert model.decode([10 ** 9, -3]) == model.decode([last, 0])


def test_describe_without_a_gpu_matches_the_reader():
    described = families.describe(TINY)
    container = cact.load(TINY)
    assert described["family"] == "needle3"
    assert described["tensor_bytes"] == container.tensor_bytes
    assert described["geometry"]["d_model"] == container.geometry.d_model


@pytest.mark.parametrize("head,error", [(b"GGUF\x03\0\0\0", ContainerError), (b"\x83\x2a\xe1\x05", UnsupportedModelError),
                                        (b"", ContainerError), (b"PK\x03\x04", ContainerError)])
def test_unknown_or_refused_magics_are_typed_errors_before_any_device(head, error):
    with pytest.raises(error):
        needle_wgpu.load(head + bytes(64))  # fails in the reader, before a device is opened


def test_should_stop_ends_a_request_between_prefill_chunks_and_steps(device):
    """``should_stop(done, total)`` is asked before each 64-position prefill chunk and each
    decode step; a true answer finishes "stopped" there (the page's Stop button)."""
    model = needle_wgpu.load(TINY, device=device)
    ids = [2] + [5 + i % 400 for i in range(139)]  # three chunks: 64 + 64 + 12
    asked = []

    def stop_at_second_chunk(done, total):
        asked.append((done, total))
        return done >= 64

    result = model.generate(ids=ids, max_tokens=4, should_stop=stop_at_second_chunk)
    assert asked == [(0, 140), (64, 140)]
    assert result.finish_reason == "stopped" and result.ids == [] and result.text == ""

    asked.clear()
    full = model.generate(ids=ids[:5], max_tokens=4)
    stopped = model.generate(ids=ids[:5], max_tokens=4, should_stop=lambda done, total: asked.append(done) or done >= 2)
    assert asked == [0, 1, 2]  # the prefill's one chunk, then before the second and third steps
    assert stopped.finish_reason == "stopped" and stopped.ids == full.ids[:2]
    with pytest.raises(InputError, match="should_stop must be a function"):
        list(model.stream(ids=ids[:5], should_stop=3))
