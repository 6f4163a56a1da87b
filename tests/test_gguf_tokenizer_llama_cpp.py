"""The hand-made vocabularies of the unit tests, checked against llama.cpp itself: each is
written into a tiny synthetic model (spec §9) that xllamacpp loads, and its /tokenize ids
must equal ours in both modes. Skipped without xllamacpp."""

import pytest

import gguf_tokenizer_files as files
from gguf_tokenizer_files import CONTROL, USER_DEFINED, bpe_metadata, spm_metadata
from needle_wgpu.formats.gguf_tokenizer import tokenizer_from_gguf

pytestmark = pytest.mark.skipif(not files.llama_cpp_available(),
                                reason="xllamacpp is not installed")

LETTERS = [("▁", -1.0), ("a", -2.0), ("b", -2.0), ("c", -2.0), ("x", -2.0), ("y", -2.0)]
CHAT = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
        ("<tag>", USER_DEFINED), ("XY", USER_DEFINED), ("YZZ", USER_DEFINED)]

CASES = {
    "spm control token in merges": (
        lambda: spm_metadata(LETTERS + [("xy", CONTROL, -1.0)], add_space_prefix=False),
        ["xy", "axyb", "x y"]),
    "spm space prefix after specials": (
        lambda: spm_metadata(LETTERS + [("▁a", -1.5), ("▁x", -1.5),
                                        ("<tag>", USER_DEFINED, 0.0)]),
        ["a x", "a<tag>x", "<tag>", "x<tag><tag> a", "<bos>a", "<eos> <unk>"]),
    "spm user-defined space runs": (
        lambda: spm_metadata(LETTERS + [(" " * k, USER_DEFINED, 0.0) for k in range(2, 32)],
                             add_space_prefix=False),
        ["x" + " " * 33 + "y", "a b", " " * 70, "\t  \n"]),
    "spm scores, ties and bytes": (
        lambda: spm_metadata(LETTERS + [("ab", -5.0), ("bc", -4.0), ("aa", -3.0)],
                             add_space_prefix=False),
        ["abc", "aaa", "aaaa", "aé😀", "abcabcaabc" * 7]),
    # Without byte tokens llama.cpp fails on a character outside the vocabulary (HTTP 500);
    # we give the unknown token (test_spm_tokenizer), so only known characters compare here.
    "spm without byte tokens": (
        lambda: spm_metadata(LETTERS + [("?", -3.0)], byte_tokens=False, add_space_prefix=False),
        ["a?", "?ab"]),
    "bpe special tokens": (
        lambda: bpe_metadata(specials=CHAT, bos_token_id=256, eos_token_id=258),
        ["XYZZ", "XYZ XY", "<<|im_end|>>", "a<tag>b", "hi<|im_end|>", "<|im_end|"]),
    "bpe merge ranks": (lambda: bpe_metadata(["bc", "ab", "abc"], ["b c", "a b", "ab c"]),
                        ["abc", "aaa", "abcabc"]),
    "bpe duplicate merges": (lambda: bpe_metadata(["ab", "bc"], ["b c", "a b", "b c"]), ["abc"]),
    "bpe symbols outside the vocabulary": (lambda: bpe_metadata([], ["a b", "Ġ é"]),
                                           ["ab", "é", " é"]),
    "bpe llama-bpe whole words": (
        lambda: bpe_metadata(["hello"], [], pre="llama-bpe", bos_token_id=257, specials=CHAT),
        ["hello", "12345 abc", "HELLO'S"]),
    "bpe <|end|> with <|return|> and <|call|>": (
        lambda: bpe_metadata(specials=[("<|end|>", CONTROL), ("<|return|>", CONTROL),
                                       ("<|call|>", CONTROL)]),
        ["a<|end|>b", "<|return|>"]),
    "bpe default pre-tokenizer": (lambda: bpe_metadata(pre="default"),
                                  ["a+b=c 1234", "x^y|z~ 12345678"]),
    "bpe qwen2 pre-tokenizer": (lambda: bpe_metadata(pre="qwen2"),
                                ["Hello123 WORLD'S\r\n\n  x", "(a) ..\n\nb", "a\x1c\x1cb"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_hand_made_vocabulary_matches_llama_cpp(name, tmp_path):
    make, strings = CASES[name]
    metadata = make()
    path = files.write_synthetic_gguf(tmp_path / "vocab.gguf", metadata)
    ours = tokenizer_from_gguf(metadata)
    oracle = files.LlamaCppTokenizer(path)
    try:
        for text in strings:
            for add_special, parse_special in files.MODES.values():
                want = oracle.tokenize(text, add_special=add_special, parse_special=parse_special)
                got = ours.encode(text, add_special=add_special, parse_special=parse_special)
                assert got == files.without_double_bos(ours, want, add_special), \
                    (text, add_special, parse_special)
    finally:
        oracle.close()
