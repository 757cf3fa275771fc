"""Per-request sampling parameters, validated once where the request enters the system."""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.structured_output import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
EARLY_STOPPING = (True, False, "never")     # Hugging Face's (and vLLM v0's) beam-search stopping rules
# fields that reshape the distribution beam search ranks by (field, its neutral value): refused with it
_NOT_WITH_BEAMS = (("top_p", 1.0), ("top_k", -1), ("min_p", 0.0), ("presence_penalty", 0.0),
                   ("frequency_penalty", 0.0), ("repetition_penalty", 1.0), ("logit_bias", None), ("min_tokens", 0),
                   ("stop", []), ("structured_outputs", None))


class ParamError(ValueError):
    """A request parameter is out of range; `param` names it for the OpenAI error body."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestOutputKind(str, enum.Enum):
    """What a streaming API yields per step, as vLLM names it: everything so far, only what is new, or
    only the final output."""
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # streaming in-process (AsyncLLMEngine)
    structured_outputs: StructuredOutputsParams | None = None       # common/structured_output.py
    # beam search (vLLM v0's fields): n is the beam width; beams are ranked by the model's log-probabilities
    # (temperature and seed are not used), finished ones by cum_logprob / generated_len ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # set by the scheduler on a beam's own copy: the top logprobs its worker row returns (its candidates),
    # beyond the API's cap of 20 for `logprobs`
    beam_candidates: int = 0

    def __post_init__(self) -> None:
        self.output_kind = RequestOutputKind(self.output_kind)
        if isinstance(self.structured_outputs, dict):         # as it travels (to_dict)
            from common.structured_output import StructuredOutputsParams
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def num_top_logprobs(self) -> int | None:
        """Top logprobs a worker returns per sampled token (None: no logprob records at all)."""
        if self.logprobs is None and not self.beam_candidates:
            return None
        return max(self.logprobs or 0, self.beam_candidates)

    def validate(self) -> None:
        def check(ok: bool, msg: str, param: str) -> None:
            if not ok:
                raise ParamError(msg, param)

        check(1 <= self.n <= MAX_N, f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        check(self.max_tokens is None or self.max_tokens >= 1,
              f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        check(0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        check(self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (off) or at least 1, got {self.top_k}", "top_k")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        check(-2.0 <= self.presence_penalty <= 2.0,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        check(0.0 < self.repetition_penalty <= 2.0,
              f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty")
        check(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed must fit in a signed 64-bit integer", "seed")
        check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            check(v is None or 0 <= v <= MAX_TOP_LOGPROBS, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {v}", name)
        check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN for s in self.stop),
              f"stop strings must be non-empty and at most {MAX_STOP_STRING_LEN} characters", "stop")
        if self.logit_bias:
            check(all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                  "logit_bias values must be in [-100, 100]", "logit_bias")
        if self.use_beam_search:
            self._validate_beam_search(check)

    def _validate_beam_search(self, check) -> None:
        check(self.early_stopping in EARLY_STOPPING and type(self.early_stopping) in (bool, str),
              f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}", "early_stopping")
        check(-10.0 <= self.length_penalty <= 10.0,
              f"length_penalty must be in [-10, 10], got {self.length_penalty}", "length_penalty")
        for name, neutral in _NOT_WITH_BEAMS:
            value = getattr(self, name)
            check(value == neutral or not (value or neutral), f"{name} is not supported with beam search", name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["output_kind"] = self.output_kind.value
        if d["logit_bias"]:
            d["logit_bias"] = [[k, v] for k, v in d["logit_bias"].items()]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        d = dict(d)
        if d.get("logit_bias"):
            d["logit_bias"] = {int(k): float(v) for k, v in d["logit_bias"]}
        return cls(**d)


@dataclass
class BeamSearchParams:
    """vLLM's offline beam-search parameters (`LLM.beam_search`), plus Hugging Face's `early_stopping`.

    `temperature` is accepted for vLLM's signature and not used: beams are ranked by the model's own
    log-probabilities, as in HF's `generate(num_beams=..., do_sample=False)`."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(n=self.beam_width, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              temperature=0.0, length_penalty=self.length_penalty, use_beam_search=True,
                              early_stopping=self.early_stopping,
                              include_stop_str_in_output=self.include_stop_str_in_output)
