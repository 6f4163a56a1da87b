"""Conversations on the real SmolLM2 file: the kept KV cache (turn 2 prefills only its new
tokens) answers as a fresh prefill of the whole history does, rewinding after a changed system
message too; the chat command with --message/--json and interactively with /system, /reset.
Replies are kept to a few tokens (lavapipe decodes SmolLM2 at ~5 tok/s)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from needle_wgpu import cli

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_turns_reuse_the_cache_and_answer_as_a_fresh_prefill(smollm2):
    conversation = smollm2.conversation("Be brief.", context=128)
    try:
        first = conversation.send("Capital of France?", max_tokens=6)
        second = conversation.send("And of Italy?", max_tokens=6)
        one, two = conversation.turns
        assert one.reused == 0 and one.prefilled == one.prompt_tokens
        assert two.reused == one.context_used and two.prefilled == two.prompt_tokens - one.context_used
        assert two.prefilled < 20 and not two.rewound  # the new user turn only, not the history
        assert "Paris" in first["content"] and "Rome" in second["content"]
        fresh = smollm2.chat(conversation.messages[:-1], max_tokens=6, context=128)
        assert fresh["choices"][0]["message"]["content"] == second["content"]
        assert fresh["stats"]["prefilled"] == two.prompt_tokens
    finally:
        conversation.close()


def test_chat_command_with_messages_as_json_uses_the_default_model():
    env = {k: v for k, v in os.environ.items() if k not in ("NEEDLE3_MODEL", "NEEDLE_WGPU_MODEL")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "needle_wgpu", "chat", "--system", "Be brief.", "--message", "Hello!",
                           "--message", "2 plus 2?", "--max-tokens", "3", "--context", "128", "--json", "--quiet"],
                          env=env, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr
    turns = json.loads(done.stdout)["turns"]
    assert len(turns) == 2 and all(t["message"]["role"] == "assistant" for t in turns)
    assert any(c.isalpha() for c in turns[0]["message"]["content"])  # real text from SmolLM2
    assert turns[1]["stats"]["reused"] == turns[0]["stats"]["context_used"]
    assert turns[1]["stats"]["prefilled"] + turns[1]["stats"]["reused"] == turns[1]["usage"]["prompt_tokens"]
    assert turns[0]["finish_reason"] in ("eos", "length")


def test_interactive_chat_with_system_and_reset(smollm2, monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load", lambda path, progress, numerics="float": smollm2)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi!\n/system Be a pirate.\nHi!\n/reset\nHi!\n/quit\n"))
    assert cli.main(["chat", "unused.gguf", "--system", "Be brief.", "--max-tokens", "3", "--context", "128",
                     "--quiet"]) == 0
    out, err = capsys.readouterr()
    replies = out.splitlines()
    assert len(replies) == 3 and replies[0] == replies[2]  # after /reset: the first turn again, same answer
    assert "[system message set]" in err and "[conversation reset]" in err
    status = [line for line in err.splitlines() if line.startswith("[") and "context" in line]
    assert len(status) == 3 and all("/128]" in line for line in status)
    assert " + 0 reused" in status[0] and " + 0 reused" not in status[2]  # the system turn's prefix is kept
    assert "note: the history changed at position" in err  # /reset rewound past "Be a pirate."
