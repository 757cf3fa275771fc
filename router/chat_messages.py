"""Chat messages as OpenAI clients send them, reduced to what chat templates expect, and rendered with
the tokenizer's (or --chat-template's) template."""
from __future__ import annotations

from typing import Any

from router.api_error import bad

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def parse_messages(v: Any) -> list[dict[str, Any]]:
    """Messages reduced to what chat templates expect: string content, known roles, tool fields kept."""
    if not isinstance(v, list) or not v:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:      # a dict or list is not hashable
            raise bad(f"messages[{i}].role must be one of {', '.join(sorted(CHAT_ROLES))}, got {role!r}", "messages")
        msg = {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), role, i)}
        for key, kind in (("name", str), ("tool_call_id", str), ("tool_calls", list)):
            if m.get(key) is not None:
                if not isinstance(m[key], kind):
                    raise bad(f"messages[{i}].{key} must be a {'string' if kind is str else 'list'}", "messages")
                msg[key] = m[key]
        out.append(msg)
    return out


def _content(c: Any, role: str, i: int) -> str:
    if isinstance(c, str):
        return c
    if c is None and role == "assistant":      # an assistant turn that only called tools
        return ""
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only parts of the form {{\"type\": \"text\", \"text\": ...}} "
                          f"are supported", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def render_chat(messages: list[dict[str, Any]], tokenizer: Any, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
    """`tools`: the function objects, passed to the template as transformers' apply_chat_template takes
    them (a template that does not read them renders without)."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad("this model has no chat template; use /v1/completions or start with --chat-template", "messages")
    if add_generation_prompt and continue_final_message:
        raise bad("'add_generation_prompt' and 'continue_final_message' cannot both be true", "messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             tools=[{"type": "function", "function": f} for f in tools] if tools else None)
    except Exception as e:   # template errors (e.g. "roles must alternate") are the client's input
        raise bad(f"the messages could not be rendered with the model's chat template: {e}", "messages") from None
