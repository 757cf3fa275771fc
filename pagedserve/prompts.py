"""The prompt forms the offline and asyncio APIs take, as vLLM's: a string, token ids, or the dicts
{"prompt": str} (TextPrompt) and {"prompt_token_ids": [...]} (TokensPrompt)."""
from __future__ import annotations

from typing import Any

PromptType = str | list[int] | dict[str, Any]
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}


def prompt_input(prompt: PromptType, tokenizer: Any) -> tuple[list[int], str | None]:
    """(token ids, the text if there is one). A dict field we do not implement (multi_modal_data, ...) is
    an error, not ignored."""
    if isinstance(prompt, dict):
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(f"prompt fields not supported: {', '.join(sorted(unknown))}")
        text = prompt.get("prompt")
        if prompt.get("prompt_token_ids") is not None:
            return [int(t) for t in prompt["prompt_token_ids"]], text
        if isinstance(text, str):
            return tokenizer.encode(text), text
        raise ValueError("a prompt dict needs 'prompt' (a string) or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), prompt
    return [int(t) for t in prompt], None


def prompt_list(prompts: PromptType | list[PromptType]) -> list[PromptType]:
    """One prompt, or a list of them (a flat list of ints is one prompt of token ids)."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)
