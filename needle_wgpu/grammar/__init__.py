"""Constrained decoding: a JSON-schema subset (and literal framing) as a byte automaton, and the
per-step mask of token ids a model may sample (docs/api.md, "Constrained decoding").

    vocabulary = Vocabulary.of_tokenizer(tokenizer, rows=head_rows)   # once per tokenizer
    constraint = Constraint(Automaton(compile_schema(schema)), vocabulary)
    matcher = constraint.matcher()          # per generation
    matcher.mask()  -> bitmask bytes (vocab/8) for the sampler;  matcher.accept(id)
"""

from .automaton import Automaton, GrammarError
from .schema import Limits, compile_json_object, compile_schema
from .tokens import Constraint, Matcher, Vocabulary

__all__ = ["Automaton", "GrammarError", "Limits", "compile_json_object", "compile_schema", "Constraint", "Matcher", "Vocabulary"]
