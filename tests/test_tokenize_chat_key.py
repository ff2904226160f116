"""A chat's cache key keeps the key order of what the template prints: templates print
tools with `tojson`, which keeps it, so two requests differing only in the order of a tool
schema's properties render differently and must not share cached tokens."""

from __future__ import annotations

from typing import Any

from router.tokenize import PACKAGED_TOKENIZER, LocalTokenizer

TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def tools(*names: str) -> list[dict[str, Any]]:
    props = {name: {"type": "string"} for name in names}
    schema = {"type": "object", "properties": props}
    return [{"type": "function", "function": {"name": "weather", "parameters": schema}}]


def test_tool_schemas_differing_in_key_order_get_their_own_tokens() -> None:
    tok = LocalTokenizer(PACKAGED_TOKENIZER, chat_template=TEMPLATE)
    orders = [("city", "unit"), ("unit", "city")]
    for _ in range(3):  # cached from its second sighting on
        tok.chat(MESSAGES, extra={"tools": tools(*orders[0])})
    got = [tok.chat(MESSAGES, extra={"tools": tools(*o)}) for o in orders]
    fresh = [
        LocalTokenizer(PACKAGED_TOKENIZER, chat_template=TEMPLATE).chat(
            MESSAGES, extra={"tools": tools(*o)}
        )
        for o in orders
    ]
    assert got == fresh
    assert got[0] != got[1]
