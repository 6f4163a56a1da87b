"""Hostile chat templates (a GGUF file's ``tokenizer.chat_template`` is untrusted input): each
ends, within a bound, in the built-in ChatML fallback with a note (or a compile-time note),
executing and reading nothing (chat/template_sandbox.py). A bounded fuzzer renders random
templates built from jinja2's statements."""

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from needle_wgpu.chat.template import ChatTemplate, render_chatml

MESSAGES = [{"role": "user", "content": "Hi"}]


def hostile_templates(marker: str) -> dict:
    touch = f"'touch {marker}'"
    return {
        "dunder walk": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "cycler globals": f"{{{{ cycler.__init__.__globals__.os.popen({touch}).read() }}}}",
        "joiner globals": f"{{{{ joiner.__init__.__globals__['os'].system({touch}) }}}}",
        "namespace globals": "{{ namespace.__init__.__globals__ }}",
        "lipsum globals": f"{{{{ lipsum.__globals__['os'].system({touch}) }}}}",
        "messages mutation": "{% set _ = messages.append(1) %}{{ messages }}",
        "format attribute walk": "{{ '{0.__class__.__init__.__globals__}'.format(raise_exception) }}",
        "string multiplication": "{{ 'x' * 10000000000 }}",
        "repeated doubling": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                             "{% endfor %}{{ ns.s|length }}",
        "list multiplication then join": "{{ (['x' * 1000000] * 100000)|join }}",
        "replace growth": "{% set s = 'x' * 1000000 %}{{ s|replace('x', s) }}",
        "center width": "{{ 'x'|center(10000000000) }}",
        "format width": "{{ '%999999999d'|format(1) }}",
        "str format width": "{{ '{:>999999999}'.format(1) }}",
        "power": "{{ 10 ** 10000000000 }}",
        "huge loop without output": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "range of a list": "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
        "huge output": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
        "macro recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "include": "{% include '/etc/passwd' %}",
        "import": "{% import '/etc/passwd' as x %}{{ x }}",
        "extends": "{% extends '/etc/passwd' %}",
        "from import": "{% from 'os' import system %}{{ system('true') }}",
        "raise": "{{ raise_exception('no') }}",
        "strftime": "{{ strftime_now('%Y' * 100000000) }}",
        "indent width": "{{ ('x\\n' * 1000000)|indent('y' * 1000) }}",
    }


@pytest.mark.parametrize("name", list(hostile_templates("/x")))
def test_a_hostile_template_ends_in_the_fallback_within_a_bound(name, tmp_path):
    marker = tmp_path / "ran"
    source = hostile_templates(str(marker))[name]
    started = time.perf_counter()
    template = ChatTemplate(source)
    text = template.render(MESSAGES)
    elapsed = time.perf_counter() - started
    assert elapsed < 30.0, name
    assert not marker.exists()
    assert "root:" not in text
    if template.kind == "jinja":
        assert text == render_chatml(MESSAGES) and template.last_note, (name, text[:200])
    else:
        assert template.note and text == render_chatml(MESSAGES)


def test_a_bounded_template_still_renders_long_valid_histories():
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content ~ '|' }}{% endfor %}")
    messages = [{"role": "user", "content": "x" * 10}] * 5000
    assert template.render(messages) == "<user>xxxxxxxxxx|" * 5000 and template.last_note is None


_pieces = st.sampled_from([
    "{{ messages[0].content }}", "{% for m in messages %}{{ m.role }}{% endfor %}", "{{ 'ab' * 3 }}",
    "{% set ns = namespace(x=1) %}{{ ns.x }}", "{{ cycler('a', 'b').next() }}", "{{ joiner(',')() }}",
    "{% if add_generation_prompt %}<a>{% endif %}", "{{ tools|tojson }}", "{{ range(3)|list }}",
    "{{ x.__class__ }}", "{{ messages.pop() }}", "{{ 'x'|center(9) }}", "{% raw %}{{{% endraw %}", "{{",
    "{% for i in range(99999) %}{% endfor %}", "{{ '%s'|format(messages) }}", "{{ bos_token ~ eos_token }}",
    "{{ messages|map(attribute='content')|join(', ') }}", "{{ (messages|length) ** 3 }}", "{% endfor %}"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_pieces, max_size=6), st.text(max_size=20))
def test_fuzz_templates_render_or_fall_back(pieces, text):
    template = ChatTemplate("".join(pieces) + text.replace("{", "("))
    started = time.perf_counter()
    out = template.render(MESSAGES, tools=[{"name": "f"}])
    assert isinstance(out, str) and time.perf_counter() - started < 30.0
