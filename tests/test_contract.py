"""The no-panic contract of docs/api.md, checked without a GPU.

The engine's request handling (saturation, budgets, finish reasons, clean-up after a failure) is
plain Python around a session; here the session is a recording double, so every rule runs in
milliseconds. ``tests/gpu/test_no_panic.py`` checks the same rules against the real model.
"""

import decimal
import json
import math
import os
import re
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from needle_wgpu.formats.cact import CONFIDENCE_HEAD
from needle_wgpu.models.protocols import Capabilities
from needle_wgpu import cli, errors
from needle_wgpu.chat import needle3 as prompt
from needle_wgpu.engine import GenerationResult, Needle3
from needle_wgpu.errors import (ContainerError, ContextFullError, DeviceError, DeviceLimitError, DeviceLostError,
                                InputError, NeedleError, OutOfMemoryError, UnsupportedModelError)
from needle_wgpu.formats import cact
from needle_wgpu.formats.needle3_tokenizer import Tokenizer, synthetic_tokenizer
from needle_wgpu.inputs import real_number, whole_number
from needle_wgpu.models.session import clamp_context
from needle_wgpu.sampling import U32_MAX, Sampling, as_u32, clamp_budget, clamp_count, saturate_ids, saturate_seed
from needle_wgpu.chat.needle3 import Needle3Chat
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
        self.model = model
        self.context = clamp_context(context, model.geometry.max_seq_len)  # checked on its own below
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
        # a confidence head (the session fakes its logit), not scored alongside generation
        self.capabilities = Capabilities(heads=frozenset({CONFIDENCE_HEAD}), mask=True)
        self.name, self.warnings, self.device = "needle-wgpu-recording", [], None
        self.script = list(script)
        self.fail_at, self.fail_with = fail_at, fail_with
        self.confidence_value = confidence_value
        self.sessions = []

    def session(self, context=None, kv="f32", confidence=False, pad_masked=False):
        self.pad_masked = pad_masked  # the heads' pass asks for upstream's hidden cells (§U a)
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
    model = engine()
    assert 0.0 < model.confidence(prompt="What is", completion=" the weather") < 1.0
    assert model.gpu.pad_masked is True


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
    with pytest.raises(InputError, match=r"tools: at \[0\]\[0\]\[0\]\[0\]\.\.\..*(or a cycle)"):
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
    monkeypatch.setattr(cli, "_load", lambda path, progress, numerics="float": engine())
    path = str(tmp_path / "unused.cact")
    assert cli.main(["generate", path, "--prompt", "hi", "--max-tokens", "nan", "--temperature", "inf",
                     "--top-p", "-1", "--seed", "-7", "--quiet"]) == 0
    assert "finish: length" in capsys.readouterr().err
    assert cli.main(["generate", path, "--query", "hi", "--tools", "[{", "--quiet"]) == 2
    assert "needle-wgpu: tools: invalid JSON" in capsys.readouterr().err


def test_cli_takes_negative_values(tmp_path, capsys, monkeypatch):
    model = engine(script=TOKENIZER.encode("a -x b"))
    monkeypatch.setattr(cli, "_load", lambda path, progress, numerics="float": model)
    assert cli.main(["generate", str(tmp_path / "unused.cact"), "--prompt", "hi", "--max-tokens", "5",
                     "--seed", "-inf", "--temperature", "-1e5", "--top-k", "-1e5", "--top-p", "-1e-5",
                     "--stop", "-x", "--quiet"]) == 0
    assert model.gpu.sessions[-1].sampling == Sampling(0.0, 0, 1e-6, 0)
    assert "finish: stop" in capsys.readouterr().err


def test_cli_joins_an_option_and_its_dash_value():
    parser = cli.build_parser()
    assert cli.join_option_values(parser, ["generate", "--seed", "-inf", "--stop", "-x", "--quiet", "--", "-y"]) == [
        "generate", "--seed=-inf", "--stop=-x", "--quiet", "--", "-y"]
    assert cli.join_option_values(parser, ["generate", "--max-tokens", "-h"]) == ["generate", "--max-tokens", "-h"]


def test_cli_usage_errors_exit_through_argparse():
    with pytest.raises(SystemExit) as exit_request:
        cli.main(["generate", "--max-tokens", "many"])
    assert exit_request.value.code == 2


# ----------------------------------------------------------------------------------- numbers of any type


D = decimal.Decimal


@pytest.mark.parametrize("value,expected,changed", [
    (Fraction(10 ** 400), U32_MAX, True), (Fraction(-(10 ** 400)), 0, True), (Fraction(14, 2), 7, False),
    (Fraction(1, 3), 0, True), (D("7"), 7, False), (D("7.000"), 7, False), (D("2.5"), 0, True),
    (D("1e999999999"), U32_MAX, True), (D("-1e999999999"), 0, True), (D("NaN"), 0, True), (D("sNaN"), 0, True),
    (D("Infinity"), 0, True), (complex(3, 0), 0, True), (-0.0, 0, False),
])
def test_as_u32_reads_whole_numbers_of_any_type(value, expected, changed):
    assert as_u32(value) == (expected, changed)


def test_numpy_values_are_read_by_their_value():
    np = pytest.importorskip("numpy")
    cases = [(np.bool_(True), (1, False)), (np.array(5), (5, False)), (np.array(7.0), (7, False)),
             (np.float16(3), (3, False)), (np.array([1, 2]), (0, True)), (np.timedelta64(5, "s"), (0, True)),
             (np.datetime64("2020-01-01"), (0, True)), (np.longdouble("1e4000"), (U32_MAX, True)),
             (np.complex128(1j), (0, True)), (np.str_("7"), (0, True))]
    assert [as_u32(value) for value, _ in cases] == [expected for _, expected in cases]
    assert real_number(np.array([0.5])) is None  # an array is not a number (no size-1 guessing)
    assert Sampling.saturate(temperature=np.array([0.5, 1.0]), top_p=np.float32(0.5)) == Sampling(0.0, 0, 0.5, 0)


def test_duration_arrays_as_ids_are_zeros():
    np = pytest.importorskip("numpy")
    model = engine()
    result = model.generate(ids=np.array([1, 2], dtype="timedelta64[s]"), max_tokens=1)
    assert model.gpu.sessions[-1].prefilled == [0, 0] and result.clamped_ids == 2


anything = st.one_of(
    st.integers(), st.integers(-(2 ** 80), 2 ** 80), st.floats(), st.fractions(),
    st.decimals(allow_nan=True, allow_infinity=True), st.complex_numbers(), st.text(max_size=8),
    st.binary(max_size=8), st.none(), st.booleans(), st.lists(st.integers(), max_size=2), st.timedeltas(),
    st.sampled_from([D("1e999999999"), D("-sNaN"), Fraction(10 ** 400), "1e400", "-inf", "nan", object()]))


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(value=anything)
def test_number_readers_take_anything(value):
    """Every reader maps any value to one in its documented range, never raising."""
    u32, _ = as_u32(value)
    assert isinstance(u32, int) and 0 <= u32 <= U32_MAX
    whole, real = whole_number(value), real_number(value)
    assert whole is None or type(whole) is int
    assert real is None or type(real) is float
    s = Sampling.saturate(value, value, value, value, vocab=512)
    assert 0.0 <= s.temperature <= 100.0 and 0 <= s.top_k <= 512 and 1e-6 <= s.top_p <= 1.0
    assert 0 <= s.seed <= U32_MAX and 0 <= saturate_seed(value) <= U32_MAX
    assert 1 <= clamp_context(value, 256) <= 256 and 0 <= clamp_budget(value, 10) <= 10


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(value=st.fractions())
def test_a_fraction_is_an_id_only_when_whole(value):
    if value.denominator == 1:
        n = value.numerator
        assert as_u32(value) == (min(max(n, 0), U32_MAX), not 0 <= n <= U32_MAX)
    else:
        assert as_u32(value) == (0, True)


def test_a_sampling_built_directly_saturates_too():
    assert Sampling(temperature=NAN, top_k=2.5, top_p=-1, seed=-1) == Sampling(0.0, 2, 1e-6, U32_MAX)
    assert Sampling("x", None, INF, Fraction(10 ** 400)) == Sampling(0.0, 0, 1.0, (10 ** 400) & U32_MAX)


@pytest.mark.parametrize("context,expected", [
    (None, 256), (0, 1), (-5, 1), (6.9, 6), ("6", 6), ("6.5", 6), (NAN, 256), (INF, 256), (-INF, 256),
    (10 ** 400, 256), (-(10 ** 400), 256), ("x", 256), ([8], 256), (Fraction(13, 2), 6), (D("7"), 7), (True, 1),
])
def test_context_rule(context, expected):
    assert clamp_context(context, 256) == expected
    assert engine().logits([2] * expected, context=context) == [[0.0] * 512] * expected
    with pytest.raises(ContextFullError, match=f"{expected + 1} ids, more than the context of {expected}"):
        engine().logits([2] * (expected + 1), context=context)  # never cut silently


def test_reference_prefill_chunk_saturates():
    np = pytest.importorskip("numpy")
    from needle_wgpu.reference.needle3.model import ReferenceModel

    reference = ReferenceModel(synthesize("tiny", 0))
    ids = [2, 17, 300, 5, 9]

    def run(chunk):
        return reference.prefill(ids, reference.new_cache(), chunk=chunk)

    for chunk, same_as in ((0, 1), (-1, 1), (2.5, 2), (NAN, 64), (INF, 64), (None, 64), ("x", 64), (10 ** 9, 64)):
        np.testing.assert_array_equal(run(chunk), run(same_as))
    assert clamp_count(10 ** 9, 1, 256, 64) == 256


# ----------------------------------------------------------------------------------- text arguments


NOT_TEXT = [5, 2.5, ["a"], object()]


@pytest.mark.parametrize("value", NOT_TEXT + ["numpy"])
@pytest.mark.parametrize("argument", ["prompt", "query", "system", "confidence prompt", "completion"])
def test_text_arguments_take_text_only(argument, value):
    if value == "numpy":
        value = pytest.importorskip("numpy").array([1, 2])
    model = engine()
    calls = {"prompt": lambda: model.generate(value), "query": lambda: model.generate(query=value),
             "system": lambda: model.generate(query="q", system=value),
             "confidence prompt": lambda: model.confidence(prompt=value),
             "completion": lambda: model.confidence(prompt="a", completion=value)}
    name = argument.split()[-1]
    with pytest.raises(InputError, match=f"^{name} must be text"):
        calls[argument]()
    assert model.gpu.sessions == []
    assert model.generate("hi", max_tokens=1).ids == [100]  # still usable


def test_bytes_are_utf8_text():
    model = engine()
    assert model.encode_request(b"hello") == model.encode_request("hello")
    assert model.encode_request(bytearray(b"\xff")) == model.encode_request("\ufffd")
    assert model.encode_request(query=b"q", system=b"s") == model.encode_request(query="q", system="s")
    assert prompt.build_prompt(b"q") == prompt.build_prompt("q")
    with pytest.raises(InputError, match="query must be text"):
        prompt.build_prompt(5)


def test_stop_takes_any_iterable_of_text():
    np = pytest.importorskip("numpy")
    script = TOKENIZER.encode("the weather")
    for stop in (["wea"], np.array(["wea", "zz"]), b"wea", ("", None, "wea")):
        result = engine(script=script).generate(ids=[2], max_tokens=20, stop=stop)
        assert (result.finish_reason, result.text) == ("stop", " the "), stop
    assert engine(script=script).generate(ids=[2], max_tokens=3, stop=None).finish_reason == "length"
    for stop in (5, 2.5, released_view()):
        with pytest.raises(InputError, match="stop must be"):
            engine().generate(ids=[2], stop=stop)


def test_an_empty_prompt_needs_no_tokenizer():
    gpu = RecordingGpu()
    gpu.tokenizer = None
    assert Needle3(gpu).generate("").finish_reason == "empty"


# ----------------------------------------------------------------------------------- calls that do not fit


def test_an_unknown_keyword_names_itself_and_the_accepted_ones():
    model = engine()
    with pytest.raises(InputError, match=r"^generate: unknown keyword 'max_token' \(did you mean 'max_tokens'\?\); "
                                         r"accepted: query, tools, system, ids, max_tokens, "):
        model.generate("hi", max_token=2)


@pytest.mark.parametrize("call", [
    lambda m: m.stream(ids=[2], bogus=1), lambda m: m.generate("a", "b"), lambda m: m.logits(),
    lambda m: m.encode_request(promt="x"), lambda m: m.confidence(ids=[2], text="x"),
    lambda m: m.generate(ids=[2], result=GenerationResult("", [], "empty", 0)),
    lambda m: Needle3.load(b"", devices=None), lambda m: TOKENIZER.encode(txt="x"), lambda m: TOKENIZER.decode(),
    lambda m: TOKENIZER.piece(), lambda m: Tokenizer.from_blob(b"", 1), lambda m: cact.load(),
    lambda m: prompt.build_prompt("q", tool=[]), lambda m: prompt.parse_completion(),
    lambda m: prompt.compact_tools_json(tool=[]),
], ids=["stream", "generate positional", "logits", "encode_request", "confidence", "generate result", "load",
        "encode", "decode", "piece", "from_blob", "cact.load", "build_prompt", "parse_completion", "tools"])
def test_calls_that_do_not_fit_are_input_errors(call):
    model = engine()
    with pytest.raises(InputError, match="accepted: "):
        call(model)
    assert model.gpu.sessions == [] and model.generate(ids=[2], max_tokens=1).ids == [100]


# ----------------------------------------------------------------------------------- objects of the wrong kind


def test_load_checks_device_and_progress_before_reading_the_file():
    # object() is no source: reading it first would be a ContainerError.
    with pytest.raises(InputError, match="device must be a Device or None, got str"):
        Needle3.load(object(), device="cpu")
    with pytest.raises(InputError, match="progress must be a function or None, got str"):
        Needle3.load(object(), progress="x")


def test_stream_result_must_be_a_generation_result_and_starts_afresh():
    model = engine()
    with pytest.raises(InputError, match="result must be a GenerationResult or None, got dict"):
        list(model.stream(ids=[2], result={}))
    assert model.gpu.sessions == []
    reused = GenerationResult("junk", None, "eos", 99, 5, completion="junk")
    list(model.stream(ids=[2, 3], max_tokens=2, result=reused))
    assert (reused.ids, reused.finish_reason, reused.prompt_tokens, reused.clamped_ids) == ([100, 101], "length", 2, 0)
    assert reused.completion is None


# ----------------------------------------------------------------------------------- sources and buffers


def released_view():
    view = memoryview(b"\x02\x03")
    view.release()
    return view


class BadPath(os.PathLike):
    def __fspath__(self):
        return 5


def test_a_released_buffer_is_no_source_and_no_ids():
    with pytest.raises(ContainerError, match="the memoryview has been released"):
        cact.load(released_view())
    with pytest.raises(ContainerError, match="tokenizer: the memoryview has been released"):
        Tokenizer.from_blob(released_view())
    with pytest.raises(ContainerError, match="cannot read"):
        cact.load(BadPath())
    model = engine()
    for call in (lambda: model.generate(ids=released_view()), lambda: model.logits(released_view()),
                 lambda: model.confidence(released_view())):
        with pytest.raises(InputError, match="ids must be a sequence"):
            call()
    with pytest.raises(InputError, match="decode takes a sequence"):
        TOKENIZER.decode(released_view())


# ----------------------------------------------------------------------------------- tokenizer lookups


@pytest.mark.parametrize("token_id", [2.5, None, NAN, INF, -1, 512, "3", [3], Fraction(1, 2), D("NaN")])
def test_tokenizer_lookups_need_a_vocabulary_id(token_id):
    for lookup in (TOKENIZER.piece, TOKENIZER.piece_type, TOKENIZER.score):
        with pytest.raises(InputError, match=r"is not an id in \[0, 512\)"):
            lookup(token_id)


def test_tokenizer_lookups_read_whole_numbers():
    np = pytest.importorskip("numpy")
    assert TOKENIZER.piece(7.0) == TOKENIZER.piece(np.int64(7)) == TOKENIZER.piece(Fraction(7)) == TOKENIZER.piece(7)
    assert TOKENIZER.decode([7.0, D("8")]) == TOKENIZER.decode([7, 8])
    assert TOKENIZER.id_of(["<s>"]) is None and TOKENIZER.marker_id(None) is None
    assert TOKENIZER.marker_id("<|im_end|>") == TOKENIZER.im_end_id


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


def test_cli_generate_passes_numerics_and_kv(tmp_path, capsys, monkeypatch):
    """``--numerics deploy`` reaches load; ``--kv`` defaults to None (the model's KV mode)."""
    seen = {}

    def fake_load(path, progress, numerics="float"):
        seen["numerics"], seen["model"] = numerics, engine()
        return seen["model"]

    monkeypatch.setattr(cli, "_load", fake_load)
    path = str(tmp_path / "unused.cact")
    assert cli.main(["generate", path, "--prompt", "hi", "--max-tokens", "2", "--numerics", "deploy", "--quiet"]) == 0
    assert seen["numerics"] == "deploy" and seen["model"].gpu.sessions[-1].kv is None
    assert cli.main(["generate", path, "--prompt", "hi", "--max-tokens", "2", "--kv", "cq3", "--quiet"]) == 0
    assert seen["model"].gpu.sessions[-1].kv == "cq3"
    assert seen["numerics"] == "float"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["generate", path, "--prompt", "hi", "--numerics", "int4", "--quiet"])


def test_the_reference_raises_needle_errors_only():
    """A file whose records do not fit together makes NumPy raise deep in an op; the reference's
    public methods turn that into a ContainerError naming the method."""
    np = pytest.importorskip("numpy")
    from needle_wgpu.reference.boundary import raises_container_errors
    from needle_wgpu.reference.needle3.heads import ProbePool

    @raises_container_errors
    class Reference:
        def forward(self, ids):
            return np.zeros(2) + np.zeros(3)  # a width mismatch

    with pytest.raises(ContainerError, match=r"reference forward: the file's records do not fit together"):
        Reference().forward([1])
    pool = ProbePool.__new__(ProbePool)
    pool.positions, pool.denominator = 0, np.zeros(1)
    with pytest.raises(ContainerError, match="at least one kept position"):
        pool.output()
