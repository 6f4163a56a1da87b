"""What the commands share: the progress bar, the sampling options and their keywords, option
values that look like options, and whether a stream takes UTF-8."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import InputError


class Progress:
    """A one-line progress bar on stderr for loading and compiling."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet or not sys.stderr.isatty()

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.quiet or total <= 0:
            return
        width = 30
        filled = width * done // total
        sys.stderr.write(f"\r{stage:>10} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """The sampling options of generate and chat: read as floats, saturated as docs/api.md says."""
    parser.add_argument("--max-tokens", type=float, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=float, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=float, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--penalty-last-n", type=float, default=64, help="positions the penalties look at "
                        "(-1: the whole context, 0: off)")
    parser.add_argument("--logit-bias", default=None, help='JSON object {"token id": bias}, bias in [-100, 100]')


def sampling_keywords(args) -> dict:
    """What ``add_sampling_options`` declared, as ``Model.stream``/``Conversation.stream`` keywords;
    --logit-bias that is not a JSON object is an ``InputError``."""
    bias = None
    if args.logit_bias is not None:
        try:
            bias = json.loads(args.logit_bias)
        except ValueError as error:
            raise InputError(f"logit_bias: invalid JSON ({error})") from None
        if not isinstance(bias, dict):
            raise InputError("logit_bias: expected a JSON object {\"token id\": bias}")
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                penalty_last_n=args.penalty_last_n, logit_bias=bias)


def join_option_values(parser: argparse.ArgumentParser, argv: list) -> list:
    """argparse takes ``-inf`` or ``-1e5`` after an option for another option ("expected one
    argument"). A token that follows an option taking a value, starts with one '-' and is no
    option of the parser is that option's value: join them (``--seed=-inf``)."""
    takes_value, known = set(), set()
    parsers = [parser]
    while parsers:
        current = parsers.pop()
        for action in current._actions:  # argparse has no public view of its options
            known.update(action.option_strings)
            if action.option_strings and action.nargs is None:
                takes_value.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return out + argv[i:]
        following = argv[i + 1] if i + 1 < len(argv) else None
        if (token in takes_value and following is not None and following.startswith("-")
                and not following.startswith("--") and following != "-" and following not in known):
            out.append(f"{token}={following}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def writes_utf8(stream) -> bool:
    return (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "") == "utf8"
