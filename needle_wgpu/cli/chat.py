"""``needle-wgpu chat``: a conversation over one kept KV cache (``conversation.py``).

Interactive: each line typed is a user turn; the reply streams to stdout and a status line
(tokens, tok/s, prefilled and reused ids, context used) goes to stderr. ``/reset`` starts
over, ``/system TEXT`` replaces the system message, ``/quit`` (or end of input) leaves.
With ``--message TEXT`` (repeatable) each message is answered in turn, no prompt loop;
``--json`` then prints every turn as one JSON object.
"""

from __future__ import annotations

import json
import sys

from ..errors import ContextFullError
from .options import sampling_keywords, writes_utf8

HELP = "commands: /reset, /system TEXT, /quit"


def _options(args) -> dict:
    options = sampling_keywords(args)
    if getattr(args, "constraint", None) is not None:  # --json-schema: every reply under its grammar
        options["constraint"] = args.constraint
    return options


def status_line(stats) -> str:
    line = (f"[{stats.completion_tokens} tokens, {stats.decode_tokens_per_s:.1f} tok/s, finish: {stats.finish_reason}, "
            f"prefill {stats.prefilled} new + {stats.reused} reused in {stats.prefill_s:.2f} s, "
            f"context {stats.context_used}/{stats.context}]")
    return "\n".join([*(f"note: {n}" for n in stats.notices), line])


def _turn_json(reply: dict, stats) -> dict:
    return {"message": reply, "finish_reason": stats.finish_reason,
            "usage": {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens},
            "stats": stats.as_dict()}


def run_chat(args, model) -> int:
    conversation = model.conversation(args.system, tools=args.tools, context=args.context, kv=args.kv)
    note = model.chat_format.template.note if model.chat_format.template is not None else None
    if note and not args.json:
        print(f"note: {note}", file=sys.stderr)
    try:
        if args.message:
            turns = []
            for message in args.message:
                if args.json:
                    reply = conversation.send(message, **_options(args))
                    turns.append(_turn_json(reply, conversation.turns[-1]))
                else:
                    _answer(conversation, message, args)
            if args.json:
                print(json.dumps({"turns": turns}, ensure_ascii=not writes_utf8(sys.stdout)))
            return 0
        return _interactive(conversation, args)
    finally:
        conversation.close()


def _answer(conversation, text: str, args) -> None:
    for piece in conversation.stream(text, **_options(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    reply = conversation.messages[-1]
    if reply.get("tool_calls"):
        print(json.dumps({"tool_calls": reply["tool_calls"]}, ensure_ascii=False))
    sys.stdout.flush()
    print(status_line(conversation.turns[-1]), file=sys.stderr)


def _interactive(conversation, args) -> int:
    tty = sys.stdin.isatty()
    if tty:
        print(HELP, file=sys.stderr)
    while True:
        if tty:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() in ("/quit", "/exit"):
            return 0
        if text.strip() == "/reset":
            conversation.reset(args.system)
            print("[conversation reset]", file=sys.stderr)
            continue
        if text.startswith("/system"):
            conversation.set_system(text[len("/system"):].strip())
            print("[system message set]", file=sys.stderr)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]!r}; {HELP}", file=sys.stderr)
            continue
        try:
            _answer(conversation, text, args)
        except ContextFullError as exc:  # the message alone does not fit: say so, keep going
            print(f"needle-wgpu: {exc}", file=sys.stderr)
