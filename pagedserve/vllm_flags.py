"""vLLM's engine and server flags that have no field of ours: accepted with a one-line notice where they
mean nothing here, refused with the reason where they ask for something we do not do.

A user's vLLM launch line should either start a server that does what it says, or stop at once (exit 2)
naming the flag; never run while silently ignoring part of it. Flags we implement are config fields
(common/config.py, router/config.py), spelled as vLLM spells them; this table holds only the rest.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

SWITCH = "switch"     # --x / --no-x, no value
VALUE = "value"       # --x VALUE


@dataclass(frozen=True)
class CompatFlag:
    """`accept`: the values that mean nothing here (a switch's are "true"/"false"), taken with `notice`;
    None takes every value. Any other value is refused with `reason`."""
    names: tuple[str, ...]
    kind: str
    notice: str | None = None
    reason: str | None = None
    accept: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return "vllm_compat_" + self.names[0].lstrip("-").replace("-", "_")


def _notice(names: str | tuple[str, ...], kind: str, notice: str, accept: tuple[str, ...] | None = None,
            reason: str | None = None) -> CompatFlag:
    return CompatFlag(names if isinstance(names, tuple) else (names,), kind, notice, reason, accept)


def _refuse(names: str | tuple[str, ...], kind: str, reason: str, accept: tuple[str, ...] = ()) -> CompatFlag:
    return CompatFlag(names if isinstance(names, tuple) else (names,), kind, None, reason, accept)


_NO_GRAPHS = "pagedserve runs eagerly: there are no CUDA graphs or compiled graphs to configure"
_STRUCTURED = "structured output runs on xgrammar only, with its defaults"
_MULTIMODAL = "multimodal inputs are not supported: pagedserve serves text-only decoder models"
_OVERRIDES = "config overrides are not supported; edit the model's config.json instead"

COMPAT_FLAGS: tuple[CompatFlag, ...] = (
    # ---- meaningless here: accepted with a notice
    _notice("--enforce-eager", SWITCH, _NO_GRAPHS),
    _notice("--max-seq-len-to-capture", VALUE, _NO_GRAPHS),
    _notice(("--compilation-config", "-O"), VALUE, _NO_GRAPHS),
    _notice("--disable-async-output-proc", SWITCH, "outputs are always processed while the next step runs"),
    _notice("--trust-remote-code", SWITCH, "not needed: pagedserve runs its own implementation of each supported "
                                           "architecture and never executes code from the checkpoint"),
    _notice("--disable-log-requests", SWITCH, "requests are not logged (--access-log logs one line per HTTP request)"),
    _notice("--enable-log-requests", SWITCH, "request contents are never logged; --access-log logs one line per "
                                             "HTTP request"),
    _notice("--disable-log-stats", SWITCH, "the scheduler's periodic stats line is logged at INFO; "
                                           "--log-level WARNING hides it"),
    _notice("--enable-chunked-prefill", SWITCH, "prefill is always chunked at --max-num-batched-tokens (outputs "
                                                "are the same either way)"),
    _notice("--use-v2-block-manager", SWITCH, "the KV cache is always paged"),
    _notice("--disable-frontend-multiprocessing", SWITCH, "the API server always runs in processes of its own"),
    _notice("--disable-custom-all-reduce", SWITCH, "tensor-parallel reductions use torch.distributed's all-reduce"),
    _notice("--uvicorn-log-level", VALUE, "HTTP is served by aiohttp; --log-level sets every process's level"),
    _notice("--disable-uvicorn-access-log", SWITCH, "the access log is off unless --access-log"),
    _notice("--max-log-len", VALUE, "prompts are never logged"),
    _notice("--max-parallel-loading-workers", VALUE, "each worker loads its weights in one pass"),
    _notice("--tokenizer-pool-size", VALUE, "each router replica tokenizes in a thread of its own; "
                                            "--api-server-count adds replicas"),
    _notice("--ignore-patterns", VALUE, "nothing is downloaded: models come from disk or the local hub cache"),
    _notice("--preemption-mode", VALUE, "the scheduler swaps a preempted sequence out when --swap-space has room "
                                        "and recomputes it otherwise (--swap-space 0: always recompute)",
            ("swap", "recompute"), "expected swap or recompute"),
    _notice("--disable-sliding-window", SWITCH, "sliding-window models already serve contexts up to their window"),
    _notice("--enable-prompt-tokens-details", SWITCH, "usage always carries prompt_tokens_details.cached_tokens"),
    _notice("--lora-extra-vocab-size", VALUE, "adapters that add vocabulary are refused when they load"),
    _notice("--distributed-executor-backend", VALUE, "tensor-parallel ranks always run as processes ('mp')",
            ("mp",), "only multiprocessing ('mp') is available; Ray is not"),
    _notice("--scheduling-policy", VALUE, "requests are scheduled first come, first served", ("fcfs",),
            "priority scheduling is not implemented"),
    _notice("--tokenizer-mode", VALUE, "the fast (tokenizers) tokenizer is used", ("auto", "hf"),
            "only fast tokenizers are supported (auto)"),
    _notice("--model-impl", VALUE, "pagedserve's own model implementations are used", ("auto", "vllm"),
            "the transformers backend is not available"),
    _notice("--config-format", VALUE, "config.json is read (or the GGUF metadata)", ("auto", "hf"),
            "only Hugging Face config.json (or GGUF metadata) is read"),
    _notice("--max-logprobs", VALUE, "at most 20 logprobs per token, as vLLM's default", ("20",),
            "the logprobs limit is fixed at 20"),
    _notice("--chat-template-content-format", VALUE, "text content parts are joined into one string for the "
            "template", ("auto", "string"), "content parts are always passed to the template as strings"),
    _notice("--lora-dtype", VALUE, "adapters run in the model's dtype", ("auto",), "adapters run in the model's "
            "dtype"),
    # ---- not implemented: refused, with the value that would mean nothing accepted silently
    _refuse(("--pipeline-parallel-size", "-pp"), VALUE, "pipeline parallelism is not implemented; use "
            "--tensor-parallel-size", ("1",)),
    _refuse(("--data-parallel-size", "-dp"), VALUE, "data parallelism is not implemented; run several servers "
            "behind a load balancer", ("1",)),
    _refuse("--num-scheduler-steps", VALUE, "multi-step scheduling is not implemented (pipelined scheduling is "
            "always on)", ("1",)),
    _refuse("--cpu-offload-gb", VALUE, "weight offloading is not implemented", ("0",)),
    _refuse("--task", VALUE, "only text generation is served", ("auto", "generate")),
    _refuse("--runner", VALUE, "only text generation is served", ("auto", "generate")),
    _refuse("--tokenizer-revision", VALUE, "set --revision, which the tokenizer follows too"),
    _refuse("--code-revision", VALUE, "no code is loaded from the hub"),
    _refuse("--enable-sleep-mode", SWITCH, "sleep mode is not implemented", ("false",)),
    _refuse("--kv-transfer-config", VALUE, "disaggregated prefill (KV transfer) is not implemented"),
    _refuse(("--enable-expert-parallel", "--expert-parallel"), SWITCH, "expert parallelism is not implemented",
            ("false",)),
    _refuse("--headless", SWITCH, "headless multi-node data parallelism is not implemented", ("false",)),
    _refuse("--limit-mm-per-prompt", VALUE, _MULTIMODAL),
    _refuse("--mm-processor-kwargs", VALUE, _MULTIMODAL),
    _refuse("--allowed-local-media-path", VALUE, _MULTIMODAL),
    _refuse("--hf-overrides", VALUE, _OVERRIDES),
    _refuse("--rope-scaling", VALUE, _OVERRIDES),
    _refuse("--rope-theta", VALUE, _OVERRIDES),
    _refuse("--logits-processors", VALUE, "custom logits processors are not supported"),
    _notice("--guided-decoding-backend", VALUE, "structured output always runs on xgrammar", ("auto", "xgrammar"),
            _STRUCTURED),
    _refuse("--structured-outputs-config", VALUE, _STRUCTURED),
    _refuse("--tool-parser-plugin", VALUE, "tool-parser plugins are not supported; --tool-call-parser takes "
            "hermes or llama3_json"),
    _refuse("--reasoning-parser", VALUE, "reasoning parsers are not implemented"),
    _refuse("--enable-reasoning", SWITCH, "reasoning parsers are not implemented", ("false",)),
    _refuse(("--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs"), VALUE, "TLS is not served by pagedserve; "
            "terminate it in a proxy in front (docker/nginx.conf)"),
    _refuse("--root-path", VALUE, "serve behind a proxy that strips the path prefix"),
    _refuse("--middleware", VALUE, "custom ASGI middleware does not apply: the server is aiohttp"),
    _refuse("--otlp-traces-endpoint", VALUE, "OpenTelemetry tracing is not implemented"),
    _refuse(("--worker-cls", "--worker-extension-cls"), VALUE, "custom worker classes are not supported"),
    _refuse(("--speculative-model", "--num-speculative-tokens"), VALUE, "use --speculative-config '{\"model\": "
            "PATH, \"num_speculative_tokens\": K}' (or {\"method\": \"ngram\", ...})"),
    _refuse("--enable-lora-bias", SWITCH, "LoRA adapters with biases are not supported", ("false",)),
    _refuse("--fully-sharded-loras", SWITCH, "fully sharded LoRA is not implemented", ("false",)),
    _refuse("--long-lora-scaling-factors", VALUE, "long-context LoRA is not implemented"),
    _refuse("--quantization-param-path", VALUE, "fp8 KV scales come from the checkpoint or "
            "--calculate-kv-scales"),
    _refuse("--return-tokens-as-token-ids", SWITCH, "not implemented", ("false",)),
    _refuse("--enable-request-id-headers", SWITCH, "not implemented", ("false",)),
)


def add_compat_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("vLLM flags without an effect here (a notice) or not supported (an error)")
    for f in COMPAT_FLAGS:
        help_text = f.notice if f.accept is None else f"{f.notice or f.reason} (accepted: {', '.join(f.accept)})"
        if f.kind == SWITCH:
            group.add_argument(*f.names, dest=f.dest, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text or f.reason)
        else:
            group.add_argument(*f.names, dest=f.dest, default=None, metavar="VALUE", help=help_text or f.reason)


def check_compat(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The notices for the compatibility flags given; an error (exit 2) for one we cannot honour."""
    notices = []
    for f in COMPAT_FLAGS:
        value = getattr(args, f.dest, None)
        if value is None:
            continue
        text = str(value).lower() if f.kind == SWITCH else str(value)
        name = "/".join(f.names)                  # the user may have typed any of them
        if f.kind == SWITCH:
            shown = name if value else f"--no-{f.names[0][2:]}"
        else:
            shown = f"{name} {value}"
        if f.accept is None and f.notice is not None or f.accept is not None and text in f.accept:
            if f.notice is not None:
                notices.append(f"{shown}: {f.notice}")
        else:
            parser.error(f"{shown}: not supported: {f.reason}")
    return notices
