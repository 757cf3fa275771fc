"""Issue #12, structured output: the request fields of both APIs, the compiler's errors as 400s, the
worker's masks (drafts included), and outputs that always parse and validate on the default model where
the same prompts unconstrained do not."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from common.sampling_params import ParamError
from common.structured_output import StructuredOutputsParams, check, from_request
from pagedserve import LLM, SamplingParams

# ---- request fields -------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.unit
@pytest.mark.parametrize("body,kind,text", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json",
     json.dumps(SCHEMA)),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "json", json.dumps(SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA)),
    ({"guided_choice": ["yes", "no"]}, "choice", '["yes", "no"]'),
    ({"guided_regex": "a|b"}, "regex", "a|b"),
    ({"guided_grammar": 'root ::= "x"'}, "grammar", 'root ::= "x"'),
])
def test_every_way_of_asking_becomes_one_constraint(body, kind: str, text: str) -> None:
    so = from_request(body)
    assert (so.kind, so.text) == (kind, text)
    check(so)


@pytest.mark.unit
@pytest.mark.parametrize("body,message", [
    ({"response_format": {"type": "xml"}}, "'response_format' must be"),
    ({"response_format": {"type": "json_schema"}}, "'response_format.json_schema' must be an object"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "only one structured output constraint"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "only one structured output constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "not supported: whitespace_pattern"),
    ({"guided_choice": []}, "non-empty list of non-empty strings"),
    ({"guided_choice": ["a", ""]}, "non-empty list of non-empty strings"),
])
def test_malformed_requests_are_param_errors(body, message: str) -> None:
    with pytest.raises(ParamError, match=re.escape(message)):
        from_request(body)


@pytest.mark.unit
@pytest.mark.parametrize("so,message", [
    (StructuredOutputsParams(json='{"type": "strin"}'), 'Unsupported type "strin"'),
    (StructuredOutputsParams(json="{not json"), "Expecting property name"),
    (StructuredOutputsParams(regex="[a-"), "Unclosed '['"),
    (StructuredOutputsParams(grammar='root ::= "a" |'), "EBNF parser error"),
])
def test_a_bad_grammar_is_refused_with_the_compilers_message(so, message: str) -> None:
    with pytest.raises(ParamError, match=re.escape(message)) as e:
        check(so)
    assert not str(e.value).startswith("[") and "/project/" not in str(e.value)   # no C++ source location


@pytest.mark.unit
def test_params_travel_as_dicts_and_come_back() -> None:
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    back = SamplingParams.from_dict(sp.to_dict())
    assert back.structured_outputs == sp.structured_outputs and back.structured_outputs.key[2] is True


# ---- the worker's masks ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend(default_tokenizer):
    from gpu_worker.structured_output.xgrammar_backend import XGrammarBackend
    return XGrammarBackend(default_tokenizer, len(default_tokenizer), [default_tokenizer.eos_token_id])


@pytest.mark.unit
def test_draft_rows_are_masked_at_their_own_positions_and_the_matcher_rolls_back(backend, default_tokenizer) -> None:
    """A sequence with drafts gets one mask row per position, each after the drafts before it; a draft the
    grammar forbids ends the rows; the matcher is left where it was."""
    from gpu_worker.structured_output.manager import StructuredOutputManager

    class St:     # the parts of a SequenceState the manager reads
        seq_id, num_prompt_tokens, token_ids, grammar = "s", 1, [0], None
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="abc|abd"))
    mgr = StructuredOutputManager(lambda: backend)
    st = St()
    mgr.add(st)
    a, b, c, x = (default_tokenizer.convert_tokens_to_ids(t) for t in "abcx")

    def allowed(bitmask, row: int) -> set[int]:
        import torch
        logits = torch.zeros(bitmask.shape[0], len(default_tokenizer))
        backend.apply_bitmask(logits, bitmask, [row])
        return set(torch.nonzero(logits[row] > -1e30).flatten().tolist())
    mgr.start_masks([(st, 0, [a, b])], 3)
    bitmask, rows = mgr._pending.result()
    assert rows == [0, 1, 2]
    assert a in allowed(bitmask, 0) and b not in allowed(bitmask, 0)
    texts = lambda row: {default_tokenizer.decode([t]) for t in allowed(bitmask, row)}  # noqa: E731
    assert texts(1) == {"b", "bc", "bd"}              # after "a": what completes abc or abd
    assert texts(2) == {"c", "d"}                     # after "ab"
    mgr.start_masks([(st, 0, [x, b])], 3)
    assert mgr._pending.result()[1] == [0]            # x is forbidden: no rows past it
    assert mgr.valid_drafts(st, [a, b, x]) == 2
    mgr.accept(st, [a])                                 # the rollbacks left it at the start
    assert mgr.valid_drafts(st, [b, c]) == 2


# ---- the default model ------------------------------------------------------------------------------
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 40}}},
    "book": {"type": "object", "required": ["title", "author", "year"], "properties": {
        "title": {"type": "string", "maxLength": 40},
        "author": {"type": "object", "required": ["first", "last"], "properties": {
            "first": {"type": "string", "maxLength": 16}, "last": {"type": "string", "maxLength": 16}}},
        "year": {"type": "integer", "minimum": 1450, "maximum": 2030}}},
    "order": {"type": "object", "required": ["items"], "properties": {"items": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "required": ["name", "qty"],
                                                                  "properties": {"name": {"type": "string", "maxLength": 16},
                                                                                 "qty": {"type": "integer", "minimum": 1,
                                                                                         "maximum": 100}}}}}},
    "label": {"type": "object", "required": ["color", "confidence"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}},
    "review": {"type": "object", "required": ["ok", "score", "tags"], "properties": {
        "ok": {"type": "boolean"}, "score": {"type": "integer", "minimum": -10, "maximum": 10},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}},
}
ASKS = {
    "person": ["a chef named Ana", "a retired pilot", "my neighbour Tom", "a young violinist"],
    "book": ["a novel about the sea", "a famous Russian novel", "a book on gardening", "a children's book"],
    "order": ["two apples and a pear", "a coffee order", "office supplies", "a pizza order"],
    "label": ["the sky at noon", "fresh grass", "a ripe tomato", "the deep ocean"],
    "review": ["a great film", "a terrible hotel stay", "an average laptop", "a decent restaurant"],
}


def _prompts(tokenizer) -> list[tuple[str, str]]:
    out = []
    for name, asks in ASKS.items():
        for ask in asks:
            msg = f"Reply with a JSON object describing {ask}, following this schema: {json.dumps(SCHEMAS[name])}"
            out.append((name, tokenizer.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                                             add_generation_prompt=True)))
    return out


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", seed=0)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_json_schema_outputs_always_validate_and_unconstrained_ones_do_not(llm) -> None:
    """20 prompts over 5 schemas (nested objects, arrays, enums, required fields, bounded numbers), sampled:
    every constrained output parses and validates; the same requests without the constraint do not all."""
    prompts = _prompts(llm.tokenizer)
    assert len(prompts) == 20
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json=SCHEMAS[name]))
              for i, (name, _) in enumerate(prompts)]
    outs = llm.generate([p for _, p in prompts], params, use_tqdm=False)
    for (name, _), o in zip(prompts, outs):
        assert o.outputs[0].finish_reason == "stop", (name, o.outputs[0].text)
        assert _valid(o.outputs[0].text, SCHEMAS[name]), (name, o.outputs[0].text)
    free = llm.generate([p for _, p in prompts], [SamplingParams(temperature=0.7, seed=i, max_tokens=200)
                                                  for i in range(len(prompts))], use_tqdm=False)
    failed = sum(not _valid(o.outputs[0].text, SCHEMAS[name]) for (name, _), o in zip(prompts, free))
    print(f"\nunconstrained: {failed} of {len(prompts)} outputs do not validate; constrained: 0")
    assert failed > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_regex_choice_and_grammar_outputs_match(llm) -> None:
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Give me a code."}], tokenize=False,
                                               add_generation_prompt=True)
    cases = [(StructuredOutputsParams(regex=r"[A-Z]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[A-Z]{3}-[0-9]{4}", t)),
             (StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]),
              lambda t: t in ("alpha", "beta", "gamma delta")),
             (StructuredOutputsParams(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'),
              lambda t: re.fullmatch(r"\([0-9]+(,[0-9]+)*\)", t))]
    for so, ok in cases:
        outs = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=so)
                                           for s in range(4)], use_tqdm=False)
        for o in outs:
            assert o.outputs[0].finish_reason == "stop" and ok(o.outputs[0].text), (so, o.outputs[0].text)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_constraints_hold_with_n_prefix_caching_and_speculative_decoding(default_tokenizer) -> None:
    """n = 3 children each follow the grammar from their own tokens; repeated prompts hit the prefix cache;
    n-gram drafts are cut where the grammar forbids them and verified under per-position masks."""
    schema = SCHEMAS["order"]
    prompt = _prompts(default_tokenizer)[8][1]
    greedy_texts: list[list[str]] = []
    for kw in ({}, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                           "prompt_lookup_min": 2, "prompt_lookup_max": 4}}):
        llm = LLM(dtype="float32", **kw)
        sp = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(json=schema))
        outs = llm.generate([prompt, prompt], sp, use_tqdm=False)
        assert outs[1].num_cached_tokens > 0
        for o in outs:
            for c in o.outputs:
                assert c.finish_reason == "stop" and _valid(c.text, schema), (kw, c.text)
        greedy = SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema))
        greedy_texts.append([o.outputs[0].text for o in llm.generate([prompt], greedy, use_tqdm=False)])
    assert greedy_texts[1] == greedy_texts[0], "drafts under the grammar must not change greedy output"
    assert llm.stats.spec_num_draft_tokens > 0


@pytest.mark.unit
def test_the_compiled_grammar_cache_is_bounded_and_reuses_by_text(backend, monkeypatch) -> None:
    from gpu_worker.structured_output import manager as m
    monkeypatch.setattr(m, "MAX_CACHED", 2)
    mgr = m.StructuredOutputManager(lambda: backend)

    def seq(regex: str):
        class St:
            seq_id, num_prompt_tokens, token_ids, grammar = "s", 1, [0], None
            params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=regex))
        st = St()
        mgr.add(st)
        return st.grammar.compiled
    a = seq("a+")
    assert seq("a+") is a                                  # the same text compiles once
    seq("b+")
    seq("a+")                                              # used again: now the most recent
    seq("c+")                                              # evicts b+, the least recently used
    assert [k[1] for k in mgr._compiled] == ["a+", "c+"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_request_whose_grammar_still_compiles_waits_alone(llm, monkeypatch) -> None:
    """Its compile held on a gate: the plain request beside it decodes to the end while the constrained
    one samples nothing (its last prompt token runs again each step); released, it follows its schema."""
    import threading

    from common.protocol import EngineRequest
    from gpu_worker.structured_output.xgrammar_backend import XGrammarBackend
    gate = threading.Event()
    real = XGrammarBackend.compile
    schema = {"type": "object", "properties": {"gated": {"type": "integer"}}, "required": ["gated"]}

    def gated(self, kind: str, text: str, *args):
        if "gated" in text:
            gate.wait(timeout=120)       # the old behaviour would stall every step this long
        return real(self, kind, text, *args)
    monkeypatch.setattr(XGrammarBackend, "compile", gated)
    tok = llm.tokenizer
    ask = tok.apply_chat_template([{"role": "user", "content": "A JSON object with an integer, please."}],
                                  tokenize=False, add_generation_prompt=True)
    engine, got = llm.engine, {"c": [], "p": []}
    engine.add_request(EngineRequest("c", tok.encode(ask), SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))))
    engine.add_request(EngineRequest("p", tok.encode("Once upon a time"), SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True)))
    steps = 0
    try:
        while len(got["p"]) < 8:
            steps += 1
            for eo in engine.step():
                got[eo.request_id] += eo.new_token_ids
        assert got["c"] == [] and not gate.is_set() and steps >= 8
        assert engine.scheduler.seqs["c"].num_computed_tokens < engine.scheduler.seqs["c"].num_prompt_tokens
    finally:
        gate.set()
    while engine.has_unfinished():
        for eo in engine.step():
            got[eo.request_id] += eo.new_token_ids
    text = tok.decode(got["c"], skip_special_tokens=True)
    assert _valid(text, schema), text
    engine.scheduler.kv.check_all_free()
