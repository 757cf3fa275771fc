"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some strings, or an
EBNF grammar. The request fields of both APIs (OpenAI's `response_format`, vLLM's `structured_outputs` and
older `guided_*`) all become one StructuredOutputsParams, which travels inside SamplingParams to the
workers; there gpu_worker/structured_output compiles it once per distinct text and masks the logits.

`check()` compiles the grammar's text without a tokenizer, so a malformed schema, regex or grammar is a
400 with the compiler's own message where the request comes in. It imports xgrammar (and so torch) on
first use only: a router that never sees a constrained request never loads either.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.sampling_params import ParamError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_WHITESPACE = 20       # JSON: the longest run of whitespace between tokens (indentation fits)


@dataclass
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams (GuidedDecodingParams before it): exactly one field is set."""
    json: str | dict | None = None           # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None                # EBNF (GBNF), as xgrammar and vLLM take it
    json_object: bool | None = None           # any JSON object
    disable_any_whitespace: bool = False      # JSON: no free whitespace between tokens (vLLM's option)

    def __post_init__(self) -> None:
        given = [n for n in KINDS if getattr(self, n) not in (None, False)]
        if len(given) != 1:
            raise ParamError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) or 'none'}", "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ParamError("'choice' must be a non-empty list of non-empty strings", "structured_outputs")

    @property
    def kind(self) -> str:
        return next(n for n in KINDS if getattr(self, n) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: equal keys compile once (the workers' cache)."""
        return self.kind, self.text, self.disable_any_whitespace

    @property
    def text(self) -> str:
        """The grammar's canonical text: equal texts compile once (the workers' cache key)."""
        v = getattr(self, self.kind)
        if self.kind == "json":
            return v if isinstance(v, str) else json.dumps(v)     # key order kept: properties come in it
        if self.kind == "choice":
            return json.dumps(v)
        return "" if self.kind == "json_object" else v


GuidedDecodingParams = StructuredOutputsParams


def check(params: StructuredOutputsParams) -> None:
    """Compile the grammar without a tokenizer: ParamError with the compiler's message if it is bad."""
    import xgrammar as xgr
    try:
        grammar_of(xgr, *params.key)
    except Exception as e:      # whatever the compiler raises, the grammar's text is what is wrong
        raise ParamError(f"invalid {params.kind} for structured output: {_message(e)}",
                         "response_format" if params.kind in ("json", "json_object") else f"guided_{params.kind}") from None


def grammar_of(xgr: Any, kind: str, text: str, strict_whitespace: bool = False) -> Any:
    """The xgrammar Grammar of one constraint (shared with gpu_worker/structured_output, which compiles
    it against the model's tokenizer)."""
    if kind in ("json", "json_object"):
        if kind == "json":
            json.loads(text)                   # a schema that is not even JSON: the clearer message
        # free whitespace, but in runs of at most MAX_WHITESPACE: small models otherwise loop on newlines
        return xgr.Grammar.from_json_schema(text or '{"type": "object"}', any_whitespace=not strict_whitespace,
                                            max_whitespace_cnt=None if strict_whitespace else MAX_WHITESPACE)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
    return xgr.Grammar.from_ebnf(text)


def _message(e: Exception) -> str:
    """xgrammar prefixes its messages with a time and a C++ source location: keep what follows."""
    text = str(e).strip()
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


def from_request(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The constraint named by an OpenAI/vLLM request body, or None. Two ways of asking at once is a 400."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = body.get("response_format")
    if rf is not None:
        parsed = _response_format(rf)
        if parsed is not None:
            found.append(("response_format", parsed))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ParamError("'structured_outputs' must be an object", "structured_outputs")
        unknown = set(so) - set(KINDS) - {"disable_any_whitespace"}
        if unknown:
            raise ParamError(f"'structured_outputs' has fields that are not supported: {', '.join(sorted(unknown))}",
                             "structured_outputs")
        found.append(("structured_outputs", StructuredOutputsParams(**so)))
    for kind in ("json", "regex", "choice", "grammar"):
        v = body.get(f"guided_{kind}")
        if v is not None:
            found.append((f"guided_{kind}", StructuredOutputsParams(**{kind: v})))
    if len(found) > 1:
        raise ParamError(f"only one structured output constraint is allowed; got {', '.join(n for n, _ in found)}",
                         found[1][0])
    return found[0][1] if found else None


def _response_format(rf: Any) -> StructuredOutputsParams | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise ParamError("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                         "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return StructuredOutputsParams(json_object=True)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
        raise ParamError("'response_format.json_schema' must be an object with a 'schema' object",
                         "response_format")
    return StructuredOutputsParams(json=js.get("schema", {}))
