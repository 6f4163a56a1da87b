"""Write tests/data/tokenizer_corpus.json: the strings the GGUF tokenizers are checked on
against llama.cpp (dense-gguf spec §5.4). Hand-written cases first, then random strings from
a seeded generator (mixing the same kinds of text), so the file is reproducible.

    python3 tools/make_tokenizer_corpus.py
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

TARGET = Path(__file__).resolve().parents[1] / "tests" / "data" / "tokenizer_corpus.json"
SEED = 20260510
N_RANDOM = 300

HAND = [
    # English, contractions (any case), punctuation
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,",
    "Hello, world!",
    "hello world",
    " Hello",
    "Hello ",
    "I'm sure you'll see they've done what we'd said: it's John's, isn't it?",
    "I'M SURE YOU'LL SEE THEY'VE DONE WHAT WE'D SAID: IT'S JOHN'S, ISN'T IT?",
    "We'Re, you'Ve, she'S, I'D, they'Ll, it'T",
    "'s 't 're 've 'm 'll 'd ''s '",
    "Don't stop!!! Really?! ... (yes) [no] {maybe} <ok> \"quoted\" 'single'",
    "e-mail: first.last+tag@example.com, https://example.org/a/b?c=1&d=%20x#frag",
    "Mr. Smith paid $1,234.56 (≈ €1.1k) on 2024-05-01 at 13:45:07.",
    "What's the weather in Paris tomorrow? Turn off the bedroom lights, please.",
    # code
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "if __name__ == \"__main__\":\n        main()\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "<html><head><title>Hi</title></head><body><div class=\"x\"><table><tr><td>1</td></tr></table></div></body></html>",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "x = [1,2,3]; y = {'a': 1}; z = (lambda q: q*2)(x[0]) != None || a && b",
    "#include <stdio.h>\r\nint main(void) {\r\n    printf(\"%d\\n\", 42);\r\n}\r\n",
    "    indented four\n        indented eight\n\t\ttabs two\n",
    "<b>bold</b> a> </b> </c> x > </y",  # Gemma's one token with an inner '▁' is '>▁</'
    "supercalifragilisticexpialidocious pneumonoultramicroscopicsilicovolcanoconiosis",
    "=" * 100,
    "https://www.example.com/very/long/path/with_many_segments_and_underscores?query=string&x=1",
    "snake_case camelCase PascalCase SCREAMING_CASE kebab-case",
    "a==b!=c<=d>=e->f=>g::h...i///j\\\\k",
    "~~~ ``` ^^^ ||| $$$ +++ <<< >>> === ___ --- ***",
    # CJK and other scripts
    "日本語のテキストです。漢字、ひらがな、カタカナ。",
    "中文测试：你好，世界！这是一个句子。",
    "人工智能是计算机科学的一个分支，它企图了解智能的实质，并生产出一种新的能以人类智能相似的方式做出反应的智能机器，"
    "该领域的研究包括机器人、语言识别、图像识别、自然语言处理和专家系统等。",
    "한국어 문장입니다. 안녕하세요!",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ　１２３！？",
    "Русский текст, Ελληνικά, עברית, العربية, हिन्दी, ไทย, ქართული, Հայերեն",
    "naïve café, Straße, smörgåsbord, façade, jalapeño, Œuvre, ﬁne ligature",
    # emoji, ZWJ sequences, flags, keycaps, variation selectors, skin tones
    "emoji 😀😃😄 and 👍🏽 and a family 👨‍👩‍👧‍👦",
    "👩🏽‍💻 🏳️‍🌈 🏴‍☠️ 🧑‍🤝‍🧑 ❤️‍🔥 👁️‍🗨️",
    "flags 🇫🇷🇯🇵🇺🇸 keycaps 1️⃣2️⃣#️⃣ hearts ❤ ❤️ ♥️",
    "😀",
    "👨‍👩‍👧",
    "text😀text 😀 text",
    # combining marks
    "e\u0301 a\u0300 o\u0308 n\u0303 c\u0327",
    "Z\u0351\u0352\u0353a\u0354\u0355l\u0356g\u0357\u0358o\u0359\u035a",
    "\u0301\u0302 leading combining marks",
    "क्षत्रिय नमस्ते संस्कृतम्",
    "שָׁלוֹם עֲלֵיכֶם",
    "مَرْحَبًا بِكُمْ",
    "ผู้ใหญ่ กำลัง",
    # digits and numbers
    "0", "12", "123", "1234", "12345678901234567890",
    "3.14159 2.71828 1e-10 6.02e23 -42 +7",
    "1,000,000 and 1.000.000 and 1 000 000",
    "Arabic-Indic ٠١٢٣٤٥٦٧٨٩ Devanagari ०१२३ fullwidth １２３ superscript x²³ ½ ¾ Ⅻ ⅷ",
    "version v1.2.3-rc4, phone +1 (555) 123-4567, year 2026",
    "abc123def456 a1b2c3 1a2b3c",
    # whitespace runs
    " ", "  ", "   ", "    ", "\t", "\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", "\r",
    "a" + " " * 5 + "b",
    "a" + " " * 17 + "b",
    "x" + " " * 33 + "y",
    " " * 40,
    "trailing spaces   ",
    "   leading spaces",
    "tabs\tand\nnewlines\r\n and  double  spaces",
    "mixed \t \n \t\n  \n\t whitespace",
    "line1\n\n\n\nline5\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\nend",
    "\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\ttabs",
    "vertical\vtab form\ffeed",
    "no\u00a0break\u00a0space and ideographic\u3000space and line\u2028separator",
    "next\u0085line and file\x1cgroup\x1drecord\x1eunit\x1fseparators",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom",
    "control \x01\x02\x07\x08\x1b[0m chars",
    "",
    # special tokens (real ones of either file, partial, overlapping, adjacent)
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n",
    "<|endoftext|>",
    "<|im_end|><|im_end|><|im_start|>",
    "<<|im_end|>> <|im_end <|im_ end|>",
    "<|im_",
    "text<|endoftext|>more text<|im_start|>",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nHi!<end_of_turn>",
    "<eos><pad><unk><mask>[multimodal]<unused0><unused6241>",
    "<end_of_tu rn> <start_of_turn",
    "<start_of_image><end_of_image>",
    "literal <s> and </s> and <unk> and <0x41> are just text",
    "<table><tr><td>cell</td></tr></table> <div><span>x</span></div> <h1>T</h1>",
    "<fim_prefix>def f():<fim_suffix>\n<fim_middle>",
    "<repo_name>r<file_sep>a.py<filename>b.py<gh_stars>10<jupyter_code>x=1",
    "<reponame><issue_start>bug<issue_comment>fix<issue_closed>",
    "\n\n<|im_start|>\n\n<end_of_turn>\n\n",
    "   <|im_end|>   <end_of_turn>   ",
]

# Pools for the random strings: (weight, characters)
_ASCII_WORDS = ("the of and to in is you that it he was for on are as with his they I at be "
                "this have from or one had by word but not what all were we when your can said "
                "there use an each which she do how their if will up other about out many then "
                "them these so some her would make like him into time has look two more write go "
                "see number no way could people my than first water been call who oil its now "
                "find long down day did get come made may part Paris JSON HTTP URL API").split()
_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>",
             "<bos>", "<eos>", "<pad>", "<unused7>", "[multimodal]", "<div>", "</span>",
             "<|im_", "<end_of", "<fim_pad>", "<reponame>")


def _assigned(first: int, last: int) -> str:
    return "".join(chr(c) for c in range(first, last + 1)
                   if unicodedata.category(chr(c)) not in ("Cn", "Cs", "Co"))


_POOLS = [
    (30, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
    (10, "0123456789"),
    (12, " "),
    (4, "\n\t\r"),
    (1, "\v\f\u00a0\u3000\u2028\u0085\u1680\u2009\x1c\x1f"),
    (10, "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
    (4, "'"),
    (5, _assigned(0x00C0, 0x024F)),            # Latin-1 supplement and extended
    (3, _assigned(0x0370, 0x03FF) + _assigned(0x0400, 0x04FF)),  # Greek, Cyrillic
    (2, _assigned(0x0590, 0x05FF) + _assigned(0x0600, 0x06FF)),  # Hebrew, Arabic
    (2, _assigned(0x0900, 0x097F) + _assigned(0x0E00, 0x0E7F)),  # Devanagari, Thai
    (6, _assigned(0x4E00, 0x4FFF) + _assigned(0x3040, 0x30FF)),  # CJK, kana
    (2, _assigned(0xAC00, 0xAD00)),            # Hangul
    (3, _assigned(0x0300, 0x036F)),            # combining marks
    (4, _assigned(0x1F300, 0x1F64F) + _assigned(0x1F900, 0x1F9FF)),  # emoji
    (1, "\u200d\ufe0f\U0001F3FB\U0001F3FD\u20e3"),  # ZWJ, VS16, skin tones, keycap
    (1, _assigned(0xFF01, 0xFF5E)),            # fullwidth forms
    (1, "٠١٢٣٤٥٦٧٨٩०१२३²³½¾ⅫⅧ①⑩"),            # other numbers
    (1, "€£¥₹∑∫√≈≠≤≥→⇒•…–—“”‘’«»§¶©®™°±×÷"),  # symbols, typographic punctuation
]


def _random_string(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 12)):
        roll = rng.random()
        if roll < 0.25:
            word = rng.choice(_ASCII_WORDS)
            parts.append(rng.choice((word, word.upper(), word.capitalize(), " " + word)))
        elif roll < 0.30:
            parts.append(rng.choice(_SPECIALS))
        elif roll < 0.36:
            parts.append(rng.choice(" \n\t") * rng.randint(2, 40))
        else:
            weights = [w for w, _ in _POOLS]
            pool = rng.choices([p for _, p in _POOLS], weights)[0]
            parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
    return "".join(parts)


def corpus() -> list[str]:
    rng = random.Random(SEED)
    return HAND + [_random_string(rng) for _ in range(N_RANDOM)]


def main() -> None:
    strings = corpus()
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    with open(TARGET, "w", encoding="utf-8") as f:
        f.write('{"about": "tools/make_tokenizer_corpus.py", "strings": [\n')
        f.write(",\n".join(json.dumps(s, ensure_ascii=True) for s in strings))
        f.write("\n]}\n")
    print(f"wrote {TARGET}: {len(strings)} strings ({len(HAND)} by hand, {N_RANDOM} random)")


if __name__ == "__main__":
    main()
