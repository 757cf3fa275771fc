"""vLLM's /tokenize and /detokenize: the router's tokenizer and chat template, without the engine.

POST /tokenize takes a completion-style `prompt` (add_special_tokens defaults to true) or chat `messages`
(rendered with the chat template; add_special_tokens defaults to false, as the rendered template already
holds them) and answers {"count", "max_model_len", "tokens", "token_strs"}. POST /detokenize takes
{"tokens"} and answers {"prompt"}. Both check `model` as the generation routes do.
"""
from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from router.openai_protocol import (APIError, ModelInfo, bad, bool_field, check_model, decode_json_body, encode,
                                    parse_messages, render_chat, token_ids)


def tokenize_body(body: dict[str, Any], tokenizer: Any, model: ModelInfo) -> dict[str, Any]:
    check_model(body, model)
    chat = body.get("messages") is not None
    if chat == (body.get("prompt") is not None):
        raise bad("give exactly one of 'prompt' and 'messages'", "prompt")
    add_special = _flag(body, "add_special_tokens", not chat)
    if chat:
        text = render_chat(parse_messages(body["messages"]), tokenizer,
                           add_generation_prompt=_flag(body, "add_generation_prompt", True),
                           continue_final_message=_flag(body, "continue_final_message", False))
        param = "messages"
    else:
        text, param = body["prompt"], "prompt"
        if not isinstance(text, str):
            raise bad("'prompt' must be a string", "prompt")
    ids = encode(tokenizer, text, param, add_special_tokens=add_special)    # "" still gets a BOS if asked
    strs = tokenizer.convert_ids_to_tokens(ids) if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_body(body: dict[str, Any], tokenizer: Any, model: ModelInfo) -> dict[str, Any]:
    check_model(body, model)
    ids = token_ids(body.get("tokens"), model, "tokens")
    return {"prompt": tokenizer.decode(ids)}


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    v = bool_field(body, name)
    return default if v is None else v


def add_tokenize_routes(app: web.Application, state_of: Any) -> None:
    """`state_of(request)`: the app's ServerState (its tokenizer, executor and model_info()). The work runs
    in the tokenizer thread, as the generation routes' large bodies do: never on the event loop."""
    def route(fn: Any) -> Any:
        async def handler(request: web.Request) -> web.Response:
            st = state_of(request)
            body = decode_json_body(await request.read(), request.content_type)
            loop = asyncio.get_running_loop()
            try:
                return web.json_response(await loop.run_in_executor(st.executor, fn, body, st.tokenizer,
                                                                    st.model_info()))
            except APIError:
                raise
            except Exception as e:          # what the tokenizer cannot take is the client's input
                raise bad(f"could not process the request: {e}") from None
        return handler
    app.router.add_post("/tokenize", route(tokenize_body))
    app.router.add_post("/detokenize", route(detokenize_body))
