"""Tokenizer: the §8 RAW blob, the reference encoder and decoder, streaming, synthetic vocabs."""

import struct
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from needle_wgpu.errors import ContainerError, InputError
from needle_wgpu.formats import cact
from needle_wgpu.formats.needle3_tokenizer import (BYTE, CONTROL, MARKERS, NORMAL, UNKNOWN, USER_DEFINED,
                                          Tokenizer, synthetic_tokenizer,
                                          synthetic_tokenizer_blob)

SPACE = "\u2581"

ROUND_TRIP_TEXTS = [
    "What's the weather in Paris?",
    "Turn off the bedroom lights",
    "   leading and trailing   ",
    "tabs\tand\nnewlines\r\n and  double  spaces",
    '{"name":"get_weather","arguments":{"city":"Paris"}}',
    "<|im_start|>user\n<tools>[]</tools>\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreason\n</think>\n<tool_call>[]</tool_call>",
    "naïve café, Straße, Ελληνικά, 日本語, עברית",
    "emoji 😀👍🏽 and a ZWJ family 👨‍👩‍👧",
    "literal <s> and </s> and <unk> and <0x41> are just text",
    "<|im_start <think <tool_call",
    " ",
    "  ",
    "a" * 200,
    "",
]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fixture_blob(fixture_dir) -> bytes:
    return bytes(cact.load(fixture_dir / "tiny.cact").tokenizer)


@pytest.fixture(scope="module")
def fixture_tokenizer(fixture_blob) -> Tokenizer:
    return Tokenizer.from_blob(fixture_blob)


SYNTHETIC = {512: synthetic_tokenizer(512), 8192: synthetic_tokenizer(8192)}
PLAIN = synthetic_tokenizer(512, add_dummy_prefix=False)


@pytest.fixture(params=["fixture", 512, 8192, "no-dummy-prefix"])
def tokenizer(request) -> Tokenizer:
    if request.param == "fixture":
        return request.getfixturevalue("fixture_tokenizer")
    if request.param == "no-dummy-prefix":
        return PLAIN
    return SYNTHETIC[request.param]


def reference_encode(tok: Tokenizer, text: str) -> list:
    """A direct, quadratic transcription of the §8 reference encoder (the oracle)."""
    if not text:
        return []
    normal = {tok.piece(i): i for i in range(tok.vocab_size) if tok.piece_type(i) == NORMAL}
    markers = sorted((tok.piece(i) for i in range(tok.vocab_size)
                      if tok.piece_type(i) == USER_DEFINED), key=len, reverse=True)
    byte_ids = {int(tok.piece(i)[3:5], 16): i for i in range(tok.vocab_size)
                if tok.piece_type(i) == BYTE}

    def bpe(segment):
        symbols = list(segment)
        while len(symbols) > 1:
            best, best_at = None, -1
            for j in range(len(symbols) - 1):
                merged = normal.get(symbols[j] + symbols[j + 1])
                if merged is not None and (best is None or tok.score(merged) > best):
                    best, best_at = tok.score(merged), j
            if best_at < 0:
                break
            symbols[best_at : best_at + 2] = [symbols[best_at] + symbols[best_at + 1]]
        ids = []
        for s in symbols:
            if s in normal:
                ids.append(normal[s])
            elif tok.byte_fallback:
                ids += [byte_ids[b] for b in s.encode("utf-8")]
            else:
                ids.append(tok.unk_id)
        return ids

    escaped = text.replace(" ", SPACE)
    if tok.add_dummy_prefix:
        escaped = SPACE + escaped
    ids, pending, i = [], "", 0
    while i < len(escaped):
        marker = next((m for m in markers if escaped.startswith(m, i)), None)
        if marker is None:
            pending += escaped[i]
            i += 1
        else:
            ids += bpe(pending) + [tok.id_of(marker)]
            pending = ""
            i += len(marker)
    return ids + bpe(pending)


def small_vocab(normal_pieces, *, markers=(), byte_fallback=True, dummy=False) -> Tokenizer:
    """A hand-made vocab: specials, the given markers, 256 bytes, then (text, score) pieces."""
    pieces = ["<pad>", "</s>", "<s>", "<unk>", *markers, *(f"<0x{b:02X}>" for b in range(256))]
    types = [CONTROL, CONTROL, CONTROL, UNKNOWN] + [USER_DEFINED] * len(markers) + [BYTE] * 256
    scores = [0.0] * len(pieces)
    for text, score in normal_pieces:
        pieces.append(text)
        types.append(NORMAL)
        scores.append(score)
    return Tokenizer(pieces, scores, types, add_dummy_prefix=dummy, byte_fallback=byte_fallback)


# ----------------------------------------------------------------------------- the fixture record


def test_fixture_layout_matches_its_readme(fixture_tokenizer):
    tok = fixture_tokenizer
    assert tok.vocab_size == 512
    assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    assert [tok.piece(i) for i in range(4)] == ["<pad>", "</s>", "<s>", "<unk>"]
    assert [tok.piece_type(i) for i in range(4)] == [CONTROL, CONTROL, CONTROL, UNKNOWN]
    assert [tok.piece(i) for i in range(4, 28)] == list(MARKERS)
    assert all(tok.piece_type(i) == USER_DEFINED for i in range(4, 28))
    assert [tok.piece(i) for i in range(28, 284)] == [f"<0x{b:02X}>" for b in range(256)]
    assert all(tok.piece_type(i) == BYTE for i in range(28, 284))
    assert all(tok.piece_type(i) == NORMAL for i in range(284, 512))
    assert tok.id_of("<0x0A>") == 38  # '\n', as §9 states
    assert (tok.im_start_id, tok.im_end_id, tok.think_start_id) == (4, 5, 6)
    assert (tok.tool_call_start_id, tok.tool_call_end_id) == (10, 11)
    assert tok.stop_ids == (1, 5)


def test_fixture_blob_writes_back_byte_identical(fixture_blob, fixture_tokenizer):
    assert fixture_tokenizer.to_blob() == fixture_blob


def test_synthetic_layout_matches_the_fixture_layout():
    tok = SYNTHETIC[512]
    assert [tok.piece(i) for i in range(4, 28)] == list(MARKERS)
    assert tok.piece(28) == "<0x00>" and tok.piece(283) == "<0xFF>"
    assert tok.piece(284) == SPACE
    scores = [tok.score(i) for i in range(284, 512)]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)


@pytest.mark.parametrize("vocab_size", [300, 512, 8192])
def test_synthetic_blob_round_trips(vocab_size):
    blob = synthetic_tokenizer_blob(vocab_size)
    tok = Tokenizer.from_blob(blob)
    assert tok.vocab_size == vocab_size
    assert tok.to_blob() == blob
    assert tok == synthetic_tokenizer(vocab_size)


@pytest.mark.parametrize("vocab_size", [0, 299, 100_000])
def test_synthetic_rejects_unsupported_sizes(vocab_size):
    with pytest.raises(ValueError):
        synthetic_tokenizer(vocab_size)


def test_synthetic_8192_has_useful_merges():
    tok = SYNTHETIC[8192]
    pieces = [tok.piece(i) for i in tok.encode("What's the weather in Paris?")]
    assert pieces == [f"{SPACE}W", "hat", "'", "s", f"{SPACE}the", f"{SPACE}weather",
                      f"{SPACE}in", f"{SPACE}Paris", "?"]


# ----------------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_encode_matches_the_quadratic_reference(tokenizer, text):
    assert tokenizer.encode(text) == reference_encode(tokenizer, text)


def test_empty_text_has_no_tokens(tokenizer):
    assert tokenizer.encode("") == []
    assert tokenizer.decode([]) == ""


@pytest.mark.parametrize("marker", MARKERS)
def test_markers_encode_to_their_single_id(tokenizer, marker):
    marker_id = tokenizer.marker_id(marker)
    assert marker_id is not None and tokenizer.piece(marker_id) == marker
    expected = [tokenizer.id_of(SPACE), marker_id] if tokenizer.add_dummy_prefix else [marker_id]
    assert tokenizer.encode(marker) == expected
    ids = tokenizer.encode(f"x{marker}y{marker}")
    assert ids.count(marker_id) == 2


def test_markers_split_longest_first():
    tok = small_vocab([("a", -1.0)], markers=("<m", "<mm>"))
    assert tok.encode("<mm>a<m") == [tok.id_of("<mm>"), tok.id_of("a"), tok.id_of("<m")]


def test_merge_takes_the_highest_score():
    tok = small_vocab([("a", -1.0), ("b", -1.0), ("c", -1.0), ("ab", -3.0), ("bc", -2.0)])
    assert [tok.piece(i) for i in tok.encode("abc")] == ["a", "bc"]


def test_merge_ties_go_to_the_leftmost_pair():
    tok = small_vocab([("a", -1.0), ("ab", -2.0), ("ba", -2.0)])
    assert [tok.piece(i) for i in tok.encode("aba")] == ["ab", "a"]
    tok = small_vocab([("a", -1.0), ("aa", -2.0)])
    assert [tok.piece(i) for i in tok.encode("aaaaa")] == ["aa", "aa", "a"]


def test_byte_fallback_for_unknown_characters():
    tok = SYNTHETIC[512]
    ids = tok.encode("é")
    assert [tok.piece(i) for i in ids] == [SPACE, "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "é"


def test_without_byte_fallback_unknown_characters_become_unk():
    tok = small_vocab([("a", -1.0)], byte_fallback=False)
    assert tok.encode("aéa") == [tok.id_of("a"), tok.unk_id, tok.id_of("a")]
    assert tok.decode(tok.encode("aéa")) == "aa"  # UNKNOWN pieces decode to nothing (§8)


def test_decode_drops_control_pieces_and_skips_out_of_range_ids(tokenizer):
    ids = tokenizer.encode("hi there")
    noisy = [tokenizer.bos_id, -1, tokenizer.vocab_size, *ids, 10**12, tokenizer.eos_id,
             tokenizer.pad_id, tokenizer.unk_id]
    assert tokenizer.decode(noisy) == "hi there"


def test_lone_surrogates_do_not_raise(tokenizer):
    ids = tokenizer.encode("a\ud800b")
    assert tokenizer.decode(ids).replace("\ufffd", "") == "ab"


def test_piece_rejects_out_of_range_ids(tokenizer):
    with pytest.raises(InputError):
        tokenizer.piece(tokenizer.vocab_size)
    with pytest.raises(InputError):
        tokenizer.piece(-1)


def test_long_input_encodes_quickly():
    text = ("The quick brown fox, 42 times: {\"city\": \"Zürich\"} 😀 " * 400)[:20_000]
    for tok in (SYNTHETIC[512], SYNTHETIC[8192]):
        started = time.perf_counter()
        ids = tok.encode(text)
        elapsed = time.perf_counter() - started
        assert tok.decode(ids) == text
        assert elapsed < 5.0, f"encoding 20k characters took {elapsed:.1f} s"
    started = time.perf_counter()
    SYNTHETIC[512].encode("a" * 20_000)
    assert time.perf_counter() - started < 5.0


# Text without '▁' itself: the encoder maps ' ' to '▁', so a literal '▁' decodes as ' '.
round_trip_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",),
                                                 blacklist_characters=SPACE), max_size=60)
marker_soup = st.lists(st.sampled_from(list(MARKERS) + ["a", "the ", " ", "\n", "é", "😀", "<",
                                                        "|", "{\"", "_"]),
                       max_size=20).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(round_trip_text, marker_soup))
def test_property_round_trip_and_reference_agreement(text):
    for tok in (SYNTHETIC[512], PLAIN):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert ids == reference_encode(tok, text)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40))
def test_property_encode_never_raises(text):
    for tok in (SYNTHETIC[512], SYNTHETIC[8192]):
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        tok.decode(ids)


# ----------------------------------------------------------------------------- streaming


def stream(tok, ids, **kwargs) -> tuple:
    decoder = tok.stream_decoder(**kwargs)
    chunks = [decoder.push(i) for i in ids]
    return chunks, decoder.finish()


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_stream_equals_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    chunks, tail = stream(tokenizer, ids)
    assert "".join(chunks) + tail == tokenizer.decode(ids) == text


def test_stream_holds_back_incomplete_characters():
    tok = SYNTHETIC[512]
    ids = tok.encode("x😀")  # '▁x', then four byte pieces
    chunks, tail = stream(tok, ids)
    assert chunks == ["x", "", "", "", "😀"] and tail == ""


def test_stream_flushes_a_truncated_character_as_replacement():
    tok = SYNTHETIC[512]
    chunks, tail = stream(tok, [tok.id_of("<0xF0>"), tok.id_of("<0x9F>")])
    assert chunks == ["", ""] and tail == "\ufffd"
    assert tok.decode([tok.id_of("<0xF0>"), tok.id_of("<0x9F>")]) == "\ufffd"


def test_stream_continuing_a_text_keeps_the_leading_space():
    tok = SYNTHETIC[512]
    ids = [tok.id_of(f"{SPACE}t"), tok.id_of("h")]
    assert "".join(stream(tok, ids)[0]) == "th"
    assert "".join(stream(tok, ids, at_text_start=False)[0]) == " th"


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(min_value=-3, max_value=520), max_size=30))
def test_property_stream_equals_decode_for_any_ids(ids):
    tok = SYNTHETIC[512]
    chunks, tail = stream(tok, ids)
    assert "".join(chunks) + tail == tok.decode(ids)


# ----------------------------------------------------------------------------- malformed blobs


def _blob(pieces, *, header=None) -> bytes:
    """Assemble a blob from (score, type, raw bytes) records and header fields."""
    fields = dict(n=len(pieces), pad=0, eos=1, bos=2, unk=3, dummy=0, fallback=0, spare=0)
    fields.update(header or {})
    out = struct.pack("<IIIIIBBH", *fields.values())
    for score, kind, raw in pieces:
        out += struct.pack("<fBH", score, kind, len(raw)) + raw
    return out


GOOD = [(0.0, CONTROL, b"<pad>"), (0.0, CONTROL, b"</s>"), (0.0, CONTROL, b"<s>"),
        (0.0, UNKNOWN, b"<unk>"), (-1.0, NORMAL, b"a")]
VALID = _blob(GOOD)

MALFORMED = {
    "empty": b"",
    "header cut short": VALID[:20],
    "no pieces": _blob([], header={"n": 0}),
    "n_pieces absurd": _blob(GOOD, header={"n": 0xFFFFFFFF}),
    "n_pieces one too many": _blob(GOOD, header={"n": len(GOOD) + 1}),
    "last record truncated": VALID[:-1],
    "record header truncated": VALID[: len(VALID) - 1 - 7 + 3],
    "trailing garbage": VALID + b"\x00",
    "invalid UTF-8": _blob(GOOD[:4] + [(-1.0, NORMAL, b"\xff\xfe")]),
    "type byte out of range": _blob(GOOD[:4] + [(-1.0, 9, b"a")]),
    "eos_id out of range": _blob(GOOD, header={"eos": 5}),
    "unk_id out of range": _blob(GOOD, header={"unk": 1 << 31}),
    "unk is not UNKNOWN": _blob(GOOD, header={"unk": 4}),
    "duplicate piece": _blob(GOOD + [(-2.0, NORMAL, b"a")]),
    "empty marker": _blob(GOOD + [(0.0, USER_DEFINED, b"")]),
    "malformed byte piece": _blob(GOOD + [(0.0, BYTE, b"<0xZZ>")]),
    "byte_fallback without bytes": _blob(GOOD, header={"fallback": 1}),
    "flag not boolean": _blob(GOOD, header={"dummy": 7}),
    "NaN score": _blob(GOOD[:4] + [(float("nan"), NORMAL, b"a")]),
}


def test_the_valid_base_blob_parses():
    tok = Tokenizer.from_blob(VALID)
    assert tok.vocab_size == 5 and tok.encode("aa") == [4, 4]


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_blob_raises_container_error(name):
    with pytest.raises(ContainerError, match=r"^tokenizer: "):
        Tokenizer.from_blob(MALFORMED[name])


def test_from_blob_accepts_memoryview_slices(fixture_dir):
    view = cact.load(fixture_dir / "tiny.cact").tokenizer
    assert isinstance(view, memoryview)
    assert Tokenizer.from_blob(view).vocab_size == 512


def test_from_blob_rejects_non_bytes():
    with pytest.raises(ContainerError, match=r"^tokenizer: "):
        Tokenizer.from_blob(12345)
