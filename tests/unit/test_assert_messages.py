"""Every ``ansible.builtin.assert`` message becomes a string (or a list of strings) on its own.

ansible-core 2.19 validates ``fail_msg``/``success_msg`` as ``str_or_list_of_str`` before it
evaluates ``that``: a message templated from a dict fails the task even when the assertion holds
(found in molecule's verify: ``fail_msg: "{{ dsv41_service_control_states }}"`` failed a true
assert). Statically a template's type is unknown, so the rule is: a message that is one bare
``{{ expr }}`` must end in a filter that yields text (``to_json``, ``join``...), or read a text
field of a registered result, or concatenate with ``~`` (``.stdout``, ``.stderr``, ``.msg``, optionally sliced or defaulted
to a string). Enumerated from every assert in every YAML file under roles/, playbooks/,
molecule/ and the root playbooks.
"""

from __future__ import annotations

import re

import pytest

from yamltree import REPO, items, parsed

ASSERT = {"ansible.builtin.assert", "assert"}
MESSAGE_KEYS = ("fail_msg", "success_msg", "msg")
BARE = re.compile(r"^\s*\{\{(?P<expr>(?:(?!\}\}).)*)\}\}\s*$", re.S)
TEXT_FILTER = re.compile(
    r"\|\s*(to_json|to_nice_json|to_yaml|to_nice_yaml|string|join\(.*\)|trim|"
    r"regex_replace\(.*\)|quote)\s*$",
    re.S,
)
TEXT_FIELD = re.compile(r"\.(stdout|stderr|msg)(\[[^\]]*\])?(\s*\|\s*default\(\s*'[^']*'\s*\))?\s*$", re.S)


def _asserts():
    for path, doc in parsed():
        for item in items(doc):
            for key in ASSERT & set(item):
                if isinstance(item[key], dict):
                    yield path.relative_to(REPO), item.get("name", "?"), item[key]


def message_problem(value) -> str | None:
    """Why an assert message may not be text, or None."""
    if not isinstance(value, str):
        return None if isinstance(value, list) else f"a {type(value).__name__}"
    m = BARE.match(value)
    if not m:
        return None  # literal text around the template: the result is a string
    expr = m.group("expr").strip()
    if TEXT_FILTER.search(expr) or TEXT_FIELD.search(expr) or "~" in expr:  # ``~`` concatenates to text
        return None
    return f"'{value}' may template to a dict or list of non-strings (end it in | to_json)"


@pytest.mark.parametrize(
    "value,ok",
    [
        ("{{ states }}", False),
        ("{{ states | to_json }}", True),
        ("{{ r.stdout[-3000:] }}", True),
        ("{{ r.msg | default('none') }}", True),
        ("{{ lines | join('; ') }}", True),
        ("states: {{ states }}", True),
        ("{{ 'a ' ~ b }}", True),
        (["a", "b"], True),
        ({"a": 1}, False),
    ],
)
def test_the_rule_itself(value, ok):
    assert (message_problem(value) is None) is ok


def test_asserts_are_found():
    assert sum(1 for _ in _asserts()) >= 20


def test_every_assert_message_is_text():
    offenders = [
        f"{path}: {name}: {key}: {problem}"
        for path, name, args in _asserts()
        for key in MESSAGE_KEYS
        if key in args
        for problem in [message_problem(args[key])]
        if problem
    ]
    assert not offenders, "\n".join(offenders)
