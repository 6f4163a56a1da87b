"""The no-panic contract of docs/api.md, checked without a GPU.

The engine's request handling (saturation, budgets, finish reasons, clean-up after a failure) is
plain Python around a session; here the session is a recording double, so every rule runs in
milliseconds. ``tests/gpu/test_no_panic.py`` checks the same rules against the real model.
"""

import json
import re
from pathlib import Path

import pytest

from needle_wgpu import cli, errors, prompt
from needle_wgpu.engine import GenerationResult, Needle3
from needle_wgpu.errors import (ContainerError, ContextFullError, DeviceError, DeviceLimitError, DeviceLostError,
                                InputError, NeedleError, OutOfMemoryError, UnsupportedModelError)
from needle_wgpu.formats import cact
from needle_wgpu.formats.tokenizer import Tokenizer, synthetic_tokenizer
from needle_wgpu.sampling import U32_MAX, Sampling, as_u32, clamp_budget, saturate_ids
from needle_wgpu.prompt import Needle3Chat
from needle_wgpu.synth import GEOMETRIES, synthesize

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"
TINY = GEOMETRIES["tiny"]  # vocab 512, head_rows 512, max_seq_len 256
TOKENIZER = synthetic_tokenizer(TINY.vocab)
NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------------- a session double


class RecordingSession:
    """Stands in for ``Needle3Session``: same context rule, same position bookkeeping.

    Sampled ids cycle through ``script`` (default: 100, 101, ...); ``fail_at`` makes the n-th
    step raise ``fail_with`` (a device loss, say) to check the engine's clean-up.
    """

    def __init__(self, model, context=None, kv="f32", confidence=False):
        limit = model.geometry.max_seq_len
        try:
            context = int(context) if context is not None else limit
        except (TypeError, ValueError, OverflowError):
            context = limit
        self.model = model
        self.context = max(1, min(context, limit))
        self.kv = kv
        self.position = 0
        self.closed = False
        self.prefilled = None
        self.steps = 0
        model.sessions.append(self)

    def _next(self):
        script = self.model.script
        return script[(self.position - 1) % len(script)] if script else 100 + self.steps

    def prefill(self, ids, sampling=None):
        assert not self.closed and self.position + len(ids) <= self.context
        assert all(isinstance(i, int) and 0 <= i <= U32_MAX for i in ids)
        self.prefilled, self.sampling = list(ids), sampling
        self.position += len(ids)
        return self._next() if sampling is not None else None

    def step(self, sampling):
        assert not self.closed
        if self.position >= self.context:
            raise ContextFullError("full")
        self.steps += 1
        if self.model.fail_at == self.steps:
            raise self.model.fail_with
        self.position += 1
        return self._next()

    def all_logits(self, ids):
        self.prefill(ids)
        return [[0.0] * self.model.geometry.head_rows for _ in ids]

    def confidence_logit(self, ids):
        self.prefill(ids)
        return self.model.confidence_value

    def close(self):
        self.closed = True


class RecordingGpu:
    """A GpuModel (api.Model's protocol) that records what the engine asks of it."""

    def __init__(self, script=(), fail_at=None, fail_with=None, confidence_value=0.0):
        self.geometry = TINY
        self.tokenizer, self.chat = TOKENIZER, Needle3Chat()
        self.confidence = None  # has the capability; the session fakes the head's logit
        self.script = list(script)
        self.fail_at, self.fail_with = fail_at, fail_with
        self.confidence_value = confidence_value
        self.sessions = []

    def session(self, context=None, kv="f32", confidence=False):
        return RecordingSession(self, context=context, kv=kv, confidence=confidence)


def engine(**options):
    return Needle3(RecordingGpu(**options))


# ----------------------------------------------------------------------------------- token ids (§0 item 1)


@pytest.mark.parametrize("value,expected,changed", [
    (0, 0, False), (7, 7, False), (U32_MAX, U32_MAX, False), (True, 1, False), (7.0, 7, False),
    (-1, 0, True), (-(10 ** 30), 0, True), (U32_MAX + 1, U32_MAX, True), (10 ** 30, U32_MAX, True),
    (1e300, U32_MAX, True), (-1e300, 0, True), (7.5, 0, True), (NAN, 0, True), (INF, 0, True), (-INF, 0, True),
    ("7", 0, True), (None, 0, True), ([7], 0, True), (1j, 0, True),
])
def test_as_u32(value, expected, changed):
    assert as_u32(value) == (expected, changed)


def test_numpy_ids_follow_the_same_rule():
    np = pytest.importorskip("numpy")
    values = [np.int64(-3), np.uint64(2 ** 63), np.int32(5), np.float32(6.0), np.float64(NAN), np.zeros(2)]
    assert saturate_ids(values) == ([0, U32_MAX, 5, 6, 0, 0], 4)


def test_saturate_ids_counts_each_clamped_id_once():
    ids = [-5, 3, 511, 512, 2 ** 40, 7.5]
    assert saturate_ids(ids) == ([0, 3, 511, 512, U32_MAX, 0], 3)
    # With the vocabulary: 512 and 2^32 - 1 are also clamped (to 511, for the embedding lookup).
    assert saturate_ids(ids, vocab=512) == ([0, 3, 511, 512, U32_MAX, 0], 4)


def test_out_of_vocab_ids_reach_the_model_raw_and_are_reported():
    model = engine()
    result = model.generate(ids=[2, 511, 512, 70000, -1, 2 ** 33, 4.5], max_tokens=1)
    session = model.gpu.sessions[-1]
    # Raw u32 values go to the GPU: the embedding clamps, the Engram hash does not (§0 item 1).
    assert session.prefilled == [2, 511, 512, 70000, 0, U32_MAX, 0]
    assert result.clamped_ids == 5
    assert result.prompt_tokens == 7


@pytest.mark.parametrize("ids", [5, 2.0, object(), "2 3 4", b"\x02\x03"])
def test_ids_that_are_not_a_sequence_are_an_input_error(ids):
    model = engine()
    for call in (lambda: model.generate(ids=ids), lambda: model.logits(ids), lambda: model.confidence(ids)):
        with pytest.raises(InputError, match="ids must be a sequence"):
            call()


def test_any_iterable_of_ids_is_accepted():
    model = engine()
    assert model.generate(ids=iter([2, 3]), max_tokens=1).prompt_tokens == 2
    assert model.generate(ids=(i for i in (2, 3, 4)), max_tokens=1).prompt_tokens == 3
    assert model.generate(ids=range(2, 6), max_tokens=1).prompt_tokens == 4


# ----------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature,expected", [
    (0.0, 0.0), (-1.0, 0.0), (NAN, 0.0), (-INF, 0.0), (None, 0.0), ("hot", 0.0), (0.7, 0.7), ("0.5", 0.5),
    (1e9, 100.0), (INF, 100.0), (10 ** 400, 100.0), (-(10 ** 400), 0.0),
])
def test_temperature_saturates(temperature, expected):
    assert Sampling.saturate(temperature=temperature).temperature == expected


@pytest.mark.parametrize("top_k,expected", [
    (0, 0), (-3, 0), (NAN, 0), (None, 0), (1, 1), (40, 40), (40.9, 40), (512, 512), (513, 512), (INF, 512),
    (10 ** 400, 512),
])
def test_top_k_saturates(top_k, expected):
    assert Sampling.saturate(top_k=top_k, vocab=512).top_k == expected


@pytest.mark.parametrize("top_p,expected", [
    (1.0, 1.0), (2.0, 1.0), (INF, 1.0), (NAN, 1.0), (None, 1.0), (0.9, 0.9), (0.0, 1e-6), (-5.0, 1e-6),
    (-INF, 1e-6), (1e-30, 1e-6),
])
def test_top_p_saturates(top_p, expected):
    assert Sampling.saturate(top_p=top_p).top_p == expected


@pytest.mark.parametrize("seed,expected", [
    (0, 0), (7, 7), (-1, U32_MAX), (2 ** 32 + 5, 5), (10 ** 400, (10 ** 400) & U32_MAX), (7.9, 7), (NAN, 0),
    (INF, 0), (None, 0), ("x", 0),
])
def test_seed_saturates(seed, expected):
    assert Sampling.saturate(seed=seed).seed == expected


@pytest.mark.parametrize("max_tokens,remaining,expected", [
    (10, 100, 10), (1000, 100, 100), (INF, 100, 100), (10 ** 400, 100, 100), (0, 100, 0), (-5, 100, 0),
    (NAN, 100, 0), (None, 100, 0), ("7", 100, 7), (3.9, 100, 3), (10, 0, 0), (10, -20, 0),
])
def test_clamp_budget(max_tokens, remaining, expected):
    assert clamp_budget(max_tokens, remaining) == expected


def test_sampling_reaches_the_session_saturated():
    model = engine()
    model.generate(ids=[2, 3], max_tokens=1, temperature=NAN, top_k=-INF, top_p=INF, seed=-1)
    assert model.gpu.sessions[-1].sampling == Sampling(0.0, 0, 1.0, U32_MAX)


# ----------------------------------------------------------------------------------- lengths and budgets


def test_empty_prompt_is_an_empty_result_without_a_session():
    model = engine()
    for request in (dict(ids=[]), dict(prompt=""), dict(prompt=None), dict(ids=iter(()))):
        result = model.generate(**request)
        assert (result.text, result.ids, result.finish_reason, result.prompt_tokens) == ("", [], "empty", 0)
    assert model.gpu.sessions == []
    assert model.logits([]) == [] and model.confidence([]) == 0.5


def test_max_tokens_clamps_to_the_remaining_context():
    model = engine()
    result = model.generate(ids=[2, 3, 4], max_tokens=10 ** 9, context=8)
    assert len(result.ids) == 5 and result.finish_reason == "length"
    assert result.prompt_tokens + len(result.ids) <= 8


@pytest.mark.parametrize("length", [8, 9, 300])
def test_a_prompt_that_fills_the_context_stops_at_once(length):
    model = engine()
    result = model.generate(ids=[2] * length, max_tokens=5, context=8)
    assert (result.ids, result.finish_reason, result.prompt_tokens) == ([], "length", length)
    session = model.gpu.sessions[-1]
    assert session.prefilled is None and session.closed  # nothing ran on the device


def test_a_prompt_longer_than_max_seq_len_stops_at_once():
    model = engine()
    result = model.generate(ids=[2] * (TINY.max_seq_len + 1), max_tokens=5)
    assert (result.ids, result.finish_reason) == ([], "length")


@pytest.mark.parametrize("max_tokens", [0, -1, NAN, None, "many"])
def test_no_budget_means_no_tokens(max_tokens):
    model = engine()
    result = model.generate(ids=[2, 3], max_tokens=max_tokens)
    assert (result.ids, result.finish_reason) == ([], "length")
    assert model.gpu.sessions[-1].prefilled is None


def test_eos_and_im_end_stop_generation():
    for stop_id in (1, TOKENIZER.im_end_id):
        result = engine(script=[100, 101, stop_id, 102]).generate(ids=[2], max_tokens=10)
        assert (result.ids, result.finish_reason) == ([100, 101], "eos")


def test_stop_strings():
    text = TOKENIZER.encode("the weather")
    result = engine(script=text).generate(ids=[2], max_tokens=20, stop=["wea"])
    assert (result.finish_reason, result.text) == ("stop", " the ")
    assert engine(script=text).generate(ids=[2], max_tokens=4, stop="").finish_reason == "length"
    assert engine(script=text).generate(ids=[2], max_tokens=4, stop=[None, 5, ""]).finish_reason == "length"
    with pytest.raises(InputError, match="stop must be"):
        engine().generate(ids=[2], stop=5)


def test_stream_yields_what_generate_returns():
    model = engine()
    out = GenerationResult("", [], "empty", 0)
    events = list(model.stream(prompt="hello world", max_tokens=4, result=out))
    assert [e.id for e in events] == out.ids and "".join(e.text for e in events) == out.text
    assert out.prompt_tokens == len(model.encode_request("hello world"))


# ----------------------------------------------------------------------------------- failures leave the engine usable


@pytest.mark.parametrize("error", [DeviceLostError("gone"), OutOfMemoryError("full"), DeviceError("scope")])
def test_a_failing_session_is_closed_and_the_engine_serves_the_next_request(error):
    model = engine(fail_at=2, fail_with=error)
    seen = []
    with pytest.raises(type(error)):
        for event in model.stream(ids=[2, 3], max_tokens=10):
            seen.append(event.id)
    assert seen == [100, 101] and model.gpu.sessions[-1].closed
    model.gpu.fail_at = None
    assert len(model.generate(ids=[2, 3], max_tokens=3).ids) == 3


def test_abandoning_a_stream_closes_its_session():
    model = engine()
    stream = model.stream(ids=[2], max_tokens=50)
    next(stream)
    stream.close()
    assert model.gpu.sessions[-1].closed


def test_invalid_tools_are_an_input_error_and_the_engine_stays_usable():
    model = engine()
    for tools in ("[{", "{'a': 1}", '"just a string"', "42", 42, object(), '[{"x": NaN}]'):
        with pytest.raises(InputError, match="tools: "):
            model.generate(query="hi", tools=tools)
    assert model.gpu.sessions == []
    assert model.generate(query="hi", tools='[{"name":"f"}]', max_tokens=2, context=256).completion is not None


def test_a_model_without_a_tokenizer_needs_ids():
    gpu = RecordingGpu()
    gpu.tokenizer = None
    model = Needle3(gpu)
    with pytest.raises(NeedleError, match="no tokenizer"):
        model.generate("hello")
    with pytest.raises(NeedleError, match="no tokenizer"):
        model.confidence(prompt="a", completion="b")
    assert model.generate(ids=[2, 3], max_tokens=2).ids == [100, 101]


def test_confidence_is_a_probability():
    assert engine(confidence_value=0.0).confidence([2, 3]) == 0.5
    assert engine(confidence_value=1e6).confidence([2, 3]) == 1.0
    assert engine(confidence_value=-1e6).confidence([2, 3]) == 0.0
    assert engine(confidence_value=NAN).confidence([2, 3]) == 0.0
    assert 0.0 < engine().confidence(prompt="What is", completion=" the weather") < 1.0


# ----------------------------------------------------------------------------------- text in, text out


@pytest.mark.parametrize("text", [5, None, b"bytes", ["a"]])
def test_tokenizer_encode_takes_text_only(text):
    with pytest.raises(InputError, match="encode takes a str"):
        TOKENIZER.encode(text)


def test_tokenizer_decode_skips_what_is_not_a_vocabulary_id():
    hello = TOKENIZER.encode("hello")
    assert TOKENIZER.decode(hello + [-1, 512, 2 ** 40, 2.5, None, NAN]) == TOKENIZER.decode(hello) == "hello"
    for ids in (5, "hello", b"ab"):
        with pytest.raises(InputError, match="decode takes a sequence"):
            TOKENIZER.decode(ids)


@pytest.mark.parametrize("blob", [None, 5, "text", b"", b"\x00" * 23, [1, 2]])
def test_tokenizer_from_blob_refuses_non_blobs(blob):
    with pytest.raises(ContainerError, match="tokenizer: "):
        Tokenizer.from_blob(blob)


def test_tools_json_errors():
    with pytest.raises(InputError, match=r"tools: invalid JSON at line 1 column 3"):
        prompt.compact_tools_json("[{")
    with pytest.raises(InputError, match="tools: JSON cannot be read"):
        prompt.compact_tools_json("[" * 100_000 + "]" * 100_000)
    circular = []
    circular.append(circular)
    with pytest.raises(InputError, match="tools: not serialisable"):
        prompt.compact_tools_json(circular)
    assert prompt.compact_tools_json(None) == "[]"
    assert prompt.compact_tools_json({"name": "f"}) == '[{"name":"f"}]'


@pytest.mark.parametrize("text", [None, 5, b"<tool_call>[]</tool_call>", "<tool_call>" + "[" * 100_000,
                                  "<tool_call>[" + "9" * 5000 + "]</tool_call>", "<think>", "\ud800"])
def test_parse_completion_never_raises(text):
    completion = prompt.parse_completion(text)
    assert isinstance(completion.problems, list)


# ----------------------------------------------------------------------------------- files and paths


def test_cact_load_refuses_what_is_not_a_path_or_bytes(tmp_path):
    for source in (None, 3.5, object()):
        with pytest.raises(ContainerError, match="expected a path or bytes"):
            cact.load(source)
    # An int is not a file descriptor here (open() would read fd 0 and close it).
    with pytest.raises(ContainerError, match="expected a path or bytes, got int"):
        cact.load(0)
    with pytest.raises(ContainerError, match="cannot read"):
        cact.load("model\0.cact")
    with pytest.raises(ContainerError, match="cannot read"):
        cact.load(tmp_path)  # a directory


def test_cact_load_takes_any_byte_buffer():
    data = synthesize("tiny", 0)
    np = pytest.importorskip("numpy")
    assert cact.load(np.frombuffer(data, np.uint8)).file_size == len(data)
    assert cact.load(bytearray(data)).file_size == len(data)
    # A strided view is copied, never misread.
    with pytest.raises(ContainerError, match="header: wrong tag"):
        cact.load(memoryview(data)[::2])


def test_gguf_is_not_a_cact_file():
    with pytest.raises(ContainerError, match="header: wrong tag 0x46554747"):
        cact.load(b"GGUF" + bytes(300))


# ----------------------------------------------------------------------------------- the CLI


def test_cli_reports_needle_errors_with_exit_status_2(tmp_path, capsys):
    bad = tmp_path / "bad.cact"
    bad.write_bytes(b"not a model")
    assert cli.main(["info", str(bad)]) == 2
    assert cli.main(["generate", str(tmp_path / "missing.cact"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "needle-wgpu: header: wrong tag" in err and "needle-wgpu: file " in err


def test_cli_info_on_a_valid_file(tmp_path, capsys):
    path = tmp_path / "tiny.cact"
    path.write_bytes(synthesize("tiny", 0))
    assert cli.main(["info", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["geometry"]["vocab"] == 512


def test_cli_generate_saturates_and_maps_input_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "_load", lambda path, progress: engine())
    path = str(tmp_path / "unused.cact")
    assert cli.main(["generate", path, "--prompt", "hi", "--max-tokens", "nan", "--temperature", "inf",
                     "--top-p", "-1", "--seed", "-7", "--quiet"]) == 0
    assert "finish: length" in capsys.readouterr().err
    assert cli.main(["generate", path, "--query", "hi", "--tools", "[{", "--quiet"]) == 2
    assert "needle-wgpu: tools: invalid JSON" in capsys.readouterr().err


def test_cli_usage_errors_exit_through_argparse():
    with pytest.raises(SystemExit) as exit_request:
        cli.main(["generate", "--max-tokens", "many"])
    assert exit_request.value.code == 2


# ----------------------------------------------------------------------------------- the document


PUBLIC_NAMES = ("Needle3.load", "stream", "generate", "logits", "confidence", "encode_request",
                "cact.load", "Tokenizer.from_blob", "encode", "decode", "compact_tools_json", "build_prompt",
                "parse_completion", "needle-wgpu generate", "needle-wgpu info", "clamped_ids", ".gguf")


def test_the_contract_document_covers_every_entry_point_and_error():
    text = API_DOC.read_text()
    missing = [name for name in PUBLIC_NAMES if f"`{name}" not in text and name not in text]
    assert not missing, f"docs/api.md does not mention {missing}"
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, NeedleError)]
    assert len(classes) >= 9
    for error in classes:
        assert re.search(rf"`{error.__name__}`", text), f"docs/api.md does not describe {error.__name__}"


def test_every_error_is_a_needle_error_and_the_device_ones_are_device_errors():
    for error in (ContainerError, UnsupportedModelError, InputError, DeviceError, ContextFullError):
        assert issubclass(error, NeedleError)
    for error in (DeviceLostError, OutOfMemoryError, DeviceLimitError):
        assert issubclass(error, DeviceError)
