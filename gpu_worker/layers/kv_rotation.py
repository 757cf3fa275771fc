"""How an fp8 KV cache holds each head's q, k and v: a fixed orthogonal rotation, centres and gains.

fp8 (e4m3) keeps 3 mantissa bits, so each cached element carries a relative error of up to 1/16, and the
error of a score q.k grows with sum_i q_i^2 k_i^2. Keys concentrate much of their energy in a few channels
(and queries in the same ones), so a few rounded products dominate. Rotating q and k by the same orthogonal
matrix R leaves every score unchanged ((qR).(kR) = q.k) but spreads each vector over all channels, which
shrinks that sum by up to the head size; rotating v by R and the attention output back by R^T leaves the
output unchanged too. In exact arithmetic nothing changes; in fp8 the cache keeps more of the signal.
The same idea rotates activations before low-bit quantization in QuaRot and SpinQuant.

R is the normalized Walsh-Hadamard matrix when the head size is a power of two (every entry +-1/sqrt(d):
the most even spread), else a fixed seeded random orthogonal matrix.

Keys are also centred: a layer's keys share a large common part (the mean over tokens, per head and
channel), and subtracting one vector mu from every key changes each score of a query by the same q.mu,
which softmax ignores. So the cache holds (k - mu) R, smaller numbers with smaller absolute rounding errors,
and the attention output is unchanged in exact arithmetic. Values are centred the same way: the weights of
a query sum to 1, so the output of v - nu is the output of v minus nu, added back after the cache.

Position 0 gets a centre of its own. Trained models park much of every query's attention on the first
token (an attention sink), whose key and value are far from the others' mean and nearly the same whatever
that token is; rounded around the common mean, its large entries carried most of the cache's score error.
The cache holds position 0 around the first token's own key and value, and every reader adds the
difference back to that entry (`KVCentres.sink`; the torch, native and Triton backends), so the scores and
outputs stay exact in exact arithmetic.

Last, keys are divided and queries multiplied by one gain per channel (q.k is unchanged): the score error
of a rounded key grows with sum_c q_c^2 k_c^2 spread by R, which is least when gain_c^4 = E k_c^2 / E q_c^2
(keys after centring); half that exponent measured best. The statistics are measured once at start-up
on a fixed text (CALIBRATION_TEXT), in the same pass that sets each layer's k and v scales (its largest
entries at a quarter of the format's range: clear of e4m3's subnormals, with room for larger later ones)
unless a checkpoint gave them. Keys are not shifted where scores are soft-capped (Gemma 2): tanh does not
ignore a shift.

Measured over the shared workload's 10,178 prompt positions, e4m3 against an fp32 cache (top-1 agreement,
mean KL): rotation alone 93.8%, 0.0053; centred keys 95.1%, 0.0031; with position 0's own centres, centred
values and gains 96.7%, 0.0021; with the start-up scales 96.7%, 0.0014 (loadtest/results/fp8_kv_sink_*).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu_worker.attention.fp8_feedback import feedback_matrix

CALIBRATION_TEXT = (
    "The history of the city goes back more than two thousand years. Its markets, schools and harbours grew "
    "with the trade of the river, and in the nineteenth century the railway brought factories, new streets and "
    "a university. Today about a million people live there. Question: what would you like to know? Answer: "
    "tell me about its museums, its food and the weather in spring, and write a short Python function that "
    "sorts a list of numbers.")


def kv_rotation(head_dim: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[head_dim, head_dim] orthogonal: R @ R.T = I."""
    if head_dim & (head_dim - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r = h / head_dim ** 0.5
    else:
        g = torch.Generator().manual_seed(head_dim)
        r, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    return r.to(device=device, dtype=dtype)


KV_SCALE_HEADROOM = 4.0   # the calibration text's largest |k|, |v| go to the format's largest / 4
SMOOTHING = 0.5      # gain = (E k^2 / E q^2) ** (SMOOTHING / 4); 1 is the optimum for a perfect spread


@dataclass
class KVCentres:
    """One layer's fp8-cache statistics, all [kv heads, head_dim] (fp32): the cache holds
    ((k - centre) / gain) R and (v - centre) R, with position 0's own centres."""
    k_mean: torch.Tensor
    k_first: torch.Tensor
    v_mean: torch.Tensor
    v_first: torch.Tensor
    gain: torch.Tensor
    # [kv heads, D, D]: how keys are rounded into the cache, against the calibration queries in the cache
    # basis (attention/fp8_feedback.py); None: to nearest
    key_feedback: torch.Tensor | None = None
    # per (query heads, dtype): query gain [Hq, D], key gain 1 / gain, value centre per query head [Hq, D]
    _per_call: tuple | None = field(default=None, init=False, repr=False, compare=False)

    @staticmethod
    def measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: torch.Tensor | None = None,
                shift_keys: bool = True) -> "KVCentres":
        """From one sequence's q [T, Hq, D], k, v [T, Hkv, D] starting at position 0 (after rope).
        `r` (the rotation): also the keys' rounding against these queries' second moment, E q q' in the
        cache basis. `shift_keys` False (soft-capped scores): keys keep a zero centre, and only the gain
        applies."""
        q, k, v = q.float(), k.float(), v.float()
        k_mean, k_first = (k.mean(0), k[0]) if shift_keys else (torch.zeros_like(k[0]),) * 2
        group = q.shape[1] // k.shape[1]
        q_ms = q[1:].reshape(q.shape[0] - 1, k.shape[1], group, -1).pow(2).mean((0, 2))
        k_ms = (k[1:] - k_mean).pow(2).mean(0)
        gain = (k_ms.clamp_min(1e-12) / q_ms.clamp_min(1e-12)) ** (SMOOTHING / 4)
        gain = gain / gain.log().mean(-1, keepdim=True).exp()       # geometric mean 1: magnitudes stay put
        feedback = None
        if r is not None:
            qc = ((q * gain.repeat_interleave(group, 0)) @ r.float()).reshape(q.shape[0], k.shape[1], group, -1)
            feedback = feedback_matrix(torch.einsum("tgad,tgae->gde", qc, qc))
        return KVCentres(k_mean, k_first, v.mean(0), v[0], gain, feedback)

    def apply(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: torch.Tensor,
              r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as the attention and the cache take them; `first` [T] bool: rows at position 0."""
        q_gain, k_gain, _ = self._for(q.shape[1], q.dtype)
        at0 = first[:, None, None]
        k = (k - torch.where(at0, self.k_first, self.k_mean).to(k.dtype)) * k_gain
        v = v - torch.where(at0, self.v_first, self.v_mean).to(v.dtype)
        return (q * q_gain) @ r, k @ r, v @ r

    def _for(self, num_heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-call tensors in `dtype`, made once: every layer call of every step uses them."""
        if self._per_call is None or self._per_call[0] != (num_heads, dtype):
            group = num_heads // self.gain.shape[0]
            self._per_call = ((num_heads, dtype), self.gain.to(dtype).repeat_interleave(group, 0),
                              (1.0 / self.gain).to(dtype), self.v_mean.to(dtype).repeat_interleave(group, 0))
        return self._per_call[1:]

    def sink(self, r: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
        """[2, kv heads, D] (the centres' dtype, fp32 as measured): what a reader adds to position 0's key
        and value as the cache holds them (rotated, divided by the layer's scales), so that entry is
        centred like the others."""
        r = r.to(self.gain.dtype)
        dk = ((self.k_first - self.k_mean) / self.gain) @ r
        dv = (self.v_first - self.v_mean) @ r
        return torch.stack((dk / k_scale, dv / v_scale)).contiguous()

    def restore(self, o: torch.Tensor) -> torch.Tensor:
        """The attention output o [T, Hq, D], rotated back, plus the value centre its weights dropped."""
        return o + self._for(o.shape[1], o.dtype)[2]
