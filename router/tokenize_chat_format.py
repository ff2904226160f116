"""Which content format a chat template takes, decided from its syntax tree as vLLM's
`--chat-template-content-format auto` decides it (`vllm/renderers/hf.py`
`_detect_content_format`): "openai" when the template loops over a message's content
(`{% for part in message['content'] %}`, directly, through a macro parameter, or as a bare
`content` outside macros), so that it gets a list of parts; "string" otherwise, and
whenever the template cannot be read that way."""

from __future__ import annotations

from collections.abc import Iterator

import jinja2
import jinja2.nodes as n

from router.tokenize_conversation import ContentFormat


class _Unreadable(Exception):
    """A shape vLLM's detection gives up on (it then says "string")."""


def content_format(env: jinja2.Environment, source: str) -> ContentFormat:
    try:
        tree = env.parse(source)
        return "openai" if any(True for _ in _content_loops(tree)) else "string"
    except (jinja2.TemplateSyntaxError, _Unreadable):
        return "string"


def _reads(node: n.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` is `name` (or `name[key]`, `name.key`), possibly filtered, tested or
    sliced."""
    while (inner := _applied_to(node)) is not None:
        node = inner
    if key is None:
        return _is_name(node, name)
    if isinstance(node, n.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, n.Const) and node.arg.value == key
    return isinstance(node, n.Getattr) and _is_name(node.node, name) and node.attr == key


def _applied_to(node: n.Node) -> n.Node | None:
    """What a filter, a test or a slice is applied to."""
    if isinstance(node, (n.Filter, n.Test)):
        inner: n.Node | None = node.node
        return inner
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        sliced: n.Node = node.node
        return sliced
    return None


def _is_name(node: n.Node, name: str) -> bool:
    return isinstance(node, n.Name) and node.ctx == "load" and node.name == name


def _target(loop: n.For | n.Assign) -> str:
    if not isinstance(loop.target, n.Name):
        raise _Unreadable
    return loop.target.name


def _aliases(tree: n.Template, name: str) -> list[str]:
    """`name` and every variable set from it (`{% set loop_messages = messages[1:] %}`)."""
    found, todo = [name], [name]
    while todo:
        current = todo.pop(0)
        for assign in tree.find_all(n.Assign):
            if _reads(assign.node, current):
                alias = _target(assign)
                if alias not in found:
                    found.append(alias)
                    todo.append(alias)
    return found


def _message_vars(tree: n.Template) -> list[str]:
    """Loop variables over the messages (`{% for message in messages %}`)."""
    lists = _aliases(tree, "messages")
    return [_target(f) for f in tree.find_all(n.For) if any(_reads(f.iter, v) for v in lists)]


def _macro_content_params(tree: n.Template, messages: list[str]) -> dict[int, set[str]]:
    """Per loop inside a macro (by id): the macro's parameters that some call passes a
    message's content to."""
    out: dict[int, set[str]] = {}
    for macro in tree.find_all(n.Macro):
        params = _content_params(tree, macro, messages)
        for loop in macro.find_all(n.For):
            out[id(loop)] = params
    return out


def _content_params(tree: n.Template, macro: n.Macro, messages: list[str]) -> set[str]:
    names = [a.name for a in macro.args]
    found = set()
    for call in tree.find_all(n.Call):
        if not _is_name(call.node, macro.name):
            continue
        for i, arg in enumerate(call.args[: len(names)]):
            if any(_reads(arg, m, "content") for m in messages):
                found.add(names[i])
        for kw in call.kwargs:
            if kw.key in names and any(_reads(kw.value, m, "content") for m in messages):
                found.add(kw.key)
    return found


def _content_loops(tree: n.Template) -> Iterator[str]:
    """The loop variables over a message's content."""
    messages = _message_vars(tree)
    in_macros = _macro_content_params(tree, messages)
    for loop in tree.find_all(n.For):
        if _over_content(loop, messages, in_macros):
            yield _target(loop)


def _over_content(loop: n.For, messages: list[str], in_macros: dict[int, set[str]]) -> bool:
    """`message['content']`, a macro parameter given it, or a bare `content` outside
    macros."""
    it = loop.iter
    if any(_reads(it, m, "content") for m in messages):
        return True
    if not isinstance(it, n.Name):
        return False
    if id(loop) in in_macros:
        return it.name in in_macros[id(loop)]
    return it.name == "content"
