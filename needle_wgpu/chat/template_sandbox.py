"""The jinja2 sandbox chat templates run in: a GGUF file's ``tokenizer.chat_template`` is
untrusted input (a template that reached an unsandboxed jinja2 once executed code,
CVE-2024-34359). On top of jinja2's ``ImmutableSandboxedEnvironment`` (no dunder attributes, no
mutation of values passed in, ``range`` capped), a render is bounded in work and in size:

- every value a template builds is bounded: ``*``, ``+``, ``%``, ``**`` and ``~`` refuse a result
  longer than ``MAX_VALUE`` characters or items before building it, and so do the filters and
  string methods that can grow text (``join``, ``replace``, ``center``, ``format``, ...);
- the output is at most ``MAX_OUTPUT`` characters;
- the render runs at most ``max_steps`` template lines (a line tracer on the template's own
  frames: loops nested over ``range`` without output end too) and ``MAX_SECONDS`` seconds.

Beyond a bound the render raises ``TemplateBoundError`` (a jinja2 ``TemplateError``), and
``ChatTemplate.render`` serves the built-in ChatML instead, saying so in ``last_note``. Templates
cannot include, import or extend (no loader: every such name is missing).
"""

from __future__ import annotations

import sys
import time

from ..request_limits import LIMITS

MAX_VALUE = LIMITS.message_chars + (1 << 22)  # characters (or items) of one value a template builds
MAX_OUTPUT = MAX_VALUE  # characters of a rendered prompt
MAX_SECONDS = 20.0
BASE_STEPS = 2_000_000  # template lines a render may run, plus STEPS_PER_MESSAGE per message and tool
STEPS_PER_MESSAGE = 2_000


def bounded_environment(jinja2, nodes, Extension, ImmutableSandboxedEnvironment):
    """The environment class: the sandbox, bounded (see the module's docstring)."""
    from jinja2.compiler import CodeGenerator

    class TemplateBoundError(jinja2.exceptions.TemplateError):
        pass

    def refuse(what: str):
        raise TemplateBoundError(f"the template builds {what} beyond the bound of {MAX_VALUE}")

    def size(value) -> int:
        try:
            return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0
        except Exception:
            return 0

    def count(value) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):  # ``a ~ b``: through the bounded join
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset(("*", "+", "%", "**"))

        def bounded_concat(self, parts):
            parts = [str(p) for p in parts]
            if sum(map(len, parts)) > MAX_VALUE:
                refuse("a concatenation")
            return "".join(parts)

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                times = max(count(left), count(right))
                if times and max(size(left), size(right)) * times > MAX_VALUE:
                    refuse("a repetition")
            elif operator == "+":
                if size(left) + size(right) > MAX_VALUE:
                    refuse("a sum")
            elif operator == "**":
                if isinstance(right, (int, float)) and abs(right) > 1024 or \
                        isinstance(left, int) and abs(left) > (1 << 64):
                    refuse("a power")
            elif operator == "%" and isinstance(left, str):
                arguments = right if isinstance(right, tuple) else (right,)
                if any(count(a) > MAX_VALUE for a in arguments) or len(left) + sum(map(size, arguments)) > MAX_VALUE:
                    refuse("a formatted string")
            result = super().call_binop(context, operator, left, right)
            if size(result) > MAX_VALUE:
                refuse("a value")
            return result

        def wrap_str_format(self, value):
            """``str.format``/``format_map`` (jinja2 wraps them at attribute access): a width in
            the format string is checked before anything is built."""
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            text = value.__self__

            def bounded(*args, **kwargs):
                if growth("format", text, (*args, *kwargs.values())) > MAX_VALUE:
                    refuse("a format")
                result = wrapped(*args, **kwargs)
                if size(result) > MAX_VALUE:
                    refuse("a value")
                return result

            return bounded

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own spelling)
            if any(count(a) > MAX_VALUE for a in (*args, *kwargs.values())):
                refuse("a width or count")
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str) and growth(getattr(__obj, "__name__", ""), owner, args) > MAX_VALUE:
                refuse(f"a {__obj.__name__}")
            result = super().call(__context, __obj, *args, **kwargs)
            if size(result) > MAX_VALUE:
                refuse("a value")
            return result

    def growth(name: str, text: str, args) -> int:
        """The most characters ``text.<name>(*args)`` (or the filter of that name) can build."""
        first = args[0] if args else None
        if name == "replace" and len(args) >= 2:
            old, new = str(args[0]), str(args[1])
            hits = text.count(old) if old else len(text) + 1
            return len(text) + hits * max(len(new) - len(old), 0)
        if name == "join" and isinstance(first, (list, tuple)):
            return sum(len(str(item)) for item in first) + len(first) * len(text)
        if name == "expandtabs":
            return len(text) + text.count("\t") * (count(first) if args else 8)
        if name == "indent":
            width = len(first) if isinstance(first, str) else count(first) if args else 4
            return len(text) + (text.count("\n") + 1) * width
        if name == "wordwrap":
            wrap = args[3] if len(args) > 3 and isinstance(args[3], str) else "\n"
            return len(text) * (1 + len(wrap))
        if name in ("format", "format_map"):
            widths = [int(run) for run in _DIGITS.findall(text)]
            return len(text) + sum(size(a) for a in args) + max(widths + [0])
        return len(text) + sum(size(a) for a in args)

    def bounded_filter(name, function):
        passes = hasattr(function, "jinja_pass_arg")  # the first argument is the context or environment

        def filtered(*args, **kwargs):
            given = args[1:] if passes else args
            if any(count(a) > MAX_VALUE for a in (*given[1:], *kwargs.values())):
                refuse(f"a {name} width or count")
            value = given[0] if given else ""
            if name == "join" and isinstance(value, (list, tuple)):
                built = growth("join", str(given[1]) if len(given) > 1 else "", (value,))
            elif isinstance(value, str):
                built = growth(name, value, given[1:])
            else:
                built = 0
            if built > MAX_VALUE:
                refuse(f"a {name} result")
            result = function(*args, **kwargs)
            if size(result) > MAX_VALUE:
                refuse(f"a {name} result")
            return result

        if passes:
            filtered.jinja_pass_arg = function.jinja_pass_arg
        return filtered

    return BoundedEnvironment, TemplateBoundError, bounded_filter


_DIGITS = __import__("re").compile(r"\d{6,}")  # a format width that may matter


def bound_filters(env, bounded_filter) -> None:
    """Wraps every filter of ``env`` so that none builds a value beyond the bound."""
    for name, function in list(env.filters.items()):
        env.filters[name] = bounded_filter(name, function)


def render_bounded(template, TemplateBoundError, steps: int, **context) -> str:
    """``template.render(**context)``, within ``steps`` template lines, ``MAX_SECONDS`` and
    ``MAX_OUTPUT`` characters of output (``TemplateBoundError`` beyond them)."""
    code_name = template.root_render_func.__code__.co_filename  # "<template>": the compiled source
    deadline = time.monotonic() + MAX_SECONDS
    left = [steps]

    def on_line(frame, event, arg):
        if event == "line":
            left[0] -= 1
            if left[0] < 0 or not left[0] & 1023 and time.monotonic() > deadline:
                raise TemplateBoundError(f"the template ran more than {steps} lines or {MAX_SECONDS} s")
        return on_line

    def on_call(frame, event, arg):  # only the template's own frames are traced line by line
        return on_line if frame.f_code.co_filename == code_name else None

    before = sys.gettrace()
    sys.settrace(on_call)
    try:
        out, length = [], 0
        for piece in template.generate(**context):
            length += len(piece)
            if length > MAX_OUTPUT:
                raise TemplateBoundError(f"the template's output passes {MAX_OUTPUT} characters")
            out.append(piece)
        return "".join(out)
    finally:
        sys.settrace(before)
