"""/openapi.json (an OpenAPI 3.1 description of the routes and their bodies), /docs (Swagger UI) and
/redoc, as vLLM serves them through FastAPI; off with --disable-fastapi-docs.

The request schemas list the fields router/openai_protocol.py reads, with their types and ranges; the
tests check that the document validates as OpenAPI and that every path it names is served.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

OPENAPI_VERSION = "3.1.0"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_INT, _NUM, _BOOL, _STR = {"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "string"}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_PROMPT_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_PROMPT_STR = {"type": "string", "minLength": 1}
_STOP = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 256},
                   {"type": "array", "maxItems": 16, "items": {"type": "string", "minLength": 1, "maxLength": 256}}]}
_INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}

# Sampling fields both generation routes read (OpenAI's and vLLM's extra ones), with the ranges that
# common/sampling_params.py enforces; JSON null means "not given"
_SAMPLING: dict[str, Any] = {
    "model": _STR, "n": {"type": "integer", "minimum": 1, "maximum": 16},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1}]},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1}, "seed": _INT64,
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "stop": _STOP, "stop_token_ids": _IDS,
    "include_stop_str_in_output": _BOOL, "skip_special_tokens": _BOOL, "ignore_eos": _BOOL,
    "min_tokens": {"type": "integer", "minimum": 0}, "stream": _BOOL,
    # beam search (vLLM's fields): n is the beam width
    "use_beam_search": _BOOL, "length_penalty": {"type": "number", "minimum": -10, "maximum": 10},
    "early_stopping": {"anyOf": [_BOOL, {"const": "never"}]},
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}}, "user": _STR,
    # structured output (common/structured_output.py): at most one of these per request
    "response_format": {"anyOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"}, "json_schema": {"type": "object", "properties": {
                "name": _STR, "schema": {"type": "object"}, "strict": _nullable(_BOOL)}}}}]},
    "structured_outputs": {"type": "object", "properties": {
        "json": {"anyOf": [_STR, {"type": "object"}]}, "regex": _STR, "grammar": _STR, "json_object": _BOOL,
        "disable_any_whitespace": _BOOL,
        "choice": {"type": "array", "minItems": 1, "items": _PROMPT_STR}}},
    "guided_json": {"anyOf": [_STR, {"type": "object"}]}, "guided_regex": _STR, "guided_grammar": _STR,
    "guided_choice": {"type": "array", "minItems": 1, "items": _PROMPT_STR},
}
# stream_options only with "stream": true (as vLLM)
_STREAM_OPTIONS_NEED_STREAM = {"if": {"required": ["stream_options"]},
                               "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
_TEXT_PARTS = {"type": "array", "items": {
    "type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": _STR}}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [_STR, {"type": "null"}, _TEXT_PARTS]},
    "name": _STR, "tool_call_id": _STR, "tool_calls": {"type": "array", "items": {"type": "object"}}},
    # only an assistant turn (one that called tools) may leave its content out or null
    "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
    "then": {"required": ["content"], "properties": {"content": {"anyOf": [_STR, _TEXT_PARTS]}}}}
_USAGE = {"type": "object", "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                                           "prompt_tokens_details": _nullable({"type": "object"})}}

SCHEMAS: dict[str, Any] = {
    "CompletionRequest": {"type": "object", "required": ["prompt"], **_STREAM_OPTIONS_NEED_STREAM, "properties": {
        **_SAMPLING, "prompt": {"anyOf": [_PROMPT_STR, {"type": "array", "minItems": 1, "items": _PROMPT_STR},
                                          _PROMPT_IDS, {"type": "array", "minItems": 1, "items": _PROMPT_IDS}]},
        "max_tokens": {"type": "integer", "minimum": 1, "default": 16}, "echo": _BOOL,
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}},
    "ChatCompletionRequest": {"type": "object", "required": ["messages"], "allOf": [
        _STREAM_OPTIONS_NEED_STREAM, {"if": {"required": ["top_logprobs"]},          # top_logprobs needs logprobs
                                      "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}],
        "properties": {
        **_SAMPLING, "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        "max_tokens": {"type": "integer", "minimum": 1}, "max_completion_tokens": {"type": "integer", "minimum": 1},
        "logprobs": _BOOL, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20}}},
    "ChatMessage": _MESSAGE,
    "CompletionResponse": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR, "usage": _USAGE,
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": _INT, "text": _STR, "logprobs": _nullable({"type": "object"}),
            "finish_reason": _nullable(_STR)}}}}},
    "ChatCompletionResponse": {"type": "object", "properties": {
        "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR, "usage": _USAGE,
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": _INT, "message": _MESSAGE, "logprobs": _nullable({"type": "object"}),
            "finish_reason": _nullable(_STR)}}}}},
    "ModelList": {"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
                                         "root": _STR, "parent": _nullable(_STR),
                                         "max_model_len": _nullable(_INT)}}}}},
    "TokenizeRequest": {"type": "object", "properties": {
        "model": _STR, "prompt": _STR, "messages": {"type": "array", "items": _ref("ChatMessage")},
        "add_special_tokens": _BOOL, "add_generation_prompt": _BOOL, "continue_final_message": _BOOL,
        "return_token_strs": _BOOL}},
    "TokenizeResponse": {"type": "object", "properties": {"count": _INT, "max_model_len": _INT, "tokens": _IDS,
                                                          "token_strs": _nullable({"type": "array", "items": _STR})}},
    "DetokenizeRequest": {"type": "object", "required": ["tokens"], "properties": {"model": _STR, "tokens": _IDS}},
    "DetokenizeResponse": {"type": "object", "properties": {"prompt": _STR}},
    "LoRAAdapterRequest": {"type": "object", "required": ["lora_name"], "properties": {
        "lora_name": _STR, "lora_path": _STR}},
    "ErrorResponse": {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": _STR, "type": _STR, "param": _nullable(_STR), "code": _nullable(_STR)}}}},
}


# one server-sent event: its `data` is a JSON chunk (the response's shape, with deltas), or [DONE] last
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": _STR, "event": _STR}}


def _json(schema: str) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": _ref(schema)}}}


def _op(summary: str, response: str | None = None, request: str | None = None,
        content_type: str = "application/json", stream: bool = False) -> dict[str, Any]:
    ok: dict[str, Any] = {"description": "OK"}
    if response:
        ok["content"] = {content_type: {"schema": _ref(response)}}
        if stream:
            ok["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
    elif content_type != "application/json":
        ok["content"] = {content_type: {"schema": _STR}}
    op: dict[str, Any] = {"summary": summary, "responses": {"200": ok, "default": {"description": "an error",
                                                                                     **_json("ErrorResponse")}}}
    if request:
        op["requestBody"] = {"required": True, **_json(request)}
    return op


def openapi_document(version: str, lora_updates: bool, api_keys: bool) -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/v1/completions": {"post": _op("Create a completion", "CompletionResponse", "CompletionRequest",
                                        stream=True)},
        "/v1/chat/completions": {"post": _op("Create a chat completion", "ChatCompletionResponse",
                                             "ChatCompletionRequest", stream=True)},
        "/v1/models": {"get": _op("List the served model and its adapters", "ModelList")},
        "/tokenize": {"post": _op("Tokenize a prompt or chat messages", "TokenizeResponse", "TokenizeRequest")},
        "/detokenize": {"post": _op("Decode token ids", "DetokenizeResponse", "DetokenizeRequest")},
        "/health": {"get": _op("Liveness")},
        "/ready": {"get": _op("Readiness: warm, connected and not draining")},
        "/ping": {"get": _op("Health, as SageMaker asks for it"), "post": _op("Health, as SageMaker asks for it")},
        "/metrics": {"get": _op("Prometheus metrics", content_type="text/plain")},
        "/version": {"get": _op("The server version")},
    }
    if lora_updates:
        paths["/v1/load_lora_adapter"] = {"post": _op("Load a LoRA adapter", request="LoRAAdapterRequest",
                                                      content_type="text/plain")}
        paths["/v1/unload_lora_adapter"] = {"post": _op("Unload a LoRA adapter", request="LoRAAdapterRequest",
                                                        content_type="text/plain")}
    doc: dict[str, Any] = {"openapi": OPENAPI_VERSION, "info": {"title": "pagedserve", "version": version},
                           "paths": paths, "components": {"schemas": SCHEMAS}}
    if api_keys:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in paths.items():
            if path.startswith("/v1/"):
                for op in ops.values():
                    op["security"] = [{"bearer": []}]
    return doc


_DOCS_HTML = """<!doctype html>
<html><head><title>pagedserve - Swagger UI</title><meta charset="utf-8">
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui"});</script>
</body></html>
"""


_REDOC_HTML = """<!doctype html>
<html><head><title>pagedserve - ReDoc</title><meta charset="utf-8"></head>
<body><redoc spec-url="/openapi.json"></redoc>
<script src="https://cdn.jsdelivr.net/npm/redoc@2/bundles/redoc.standalone.js"></script>
</body></html>
"""


def add_docs_routes(app: web.Application, document: dict[str, Any]) -> None:
    """/openapi.json, /docs (Swagger UI) and /redoc, as FastAPI serves them for vLLM."""
    async def spec(_request: web.Request) -> web.Response:
        return web.json_response(document)

    def page(html: str) -> Any:
        async def handler(_request: web.Request) -> web.Response:
            return web.Response(text=html, content_type="text/html")
        return handler
    app.router.add_get("/openapi.json", spec)
    app.router.add_get("/docs", page(_DOCS_HTML))
    app.router.add_get("/redoc", page(_REDOC_HTML))
