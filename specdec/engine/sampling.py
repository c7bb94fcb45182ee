"""Logits -> probabilities -> tokens. The same processing is applied to target and draft
distributions (temperature, then min_p, top-k, then top-p), which losslessness requires."""
from __future__ import annotations

import torch
from torch import Tensor

from specdec.config import SamplingParams


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    """Per-request generator: a seeded request reproduces exactly, alone or batched."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed % (2**63))  # torch seeds are signed 64-bit
    return gen


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature / min_p / top-k / top-p.

    Greedy (temperature 0) gives a one-hot on the argmax, so greedy is the limit of sampling.
    """
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.min_p > 0.0:  # vLLM's order: temperature, min_p, then top-k and top-p
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator) -> int:
    """Draw one token from a [V] distribution with the request's generator, by inverse CDF:
    torch.multinomial takes ~0.9 ms on a 49k vocabulary on CPU, a cumsum and a binary search
    ~0.05 ms, and a sampled step draws once per drafted node plus once for the target.
    right=True skips zero-probability tokens (their CDF equals their predecessor's). In float64:
    a float32 CDF over 49k entries rounds tokens below ~3e-8 to steps of 0 or 6e-8."""
    cdf = probs.double().cumsum(-1)
    x = uniform(generator) * float(cdf[-1])
    return min(int(torch.searchsorted(cdf, torch.tensor([x]), right=True)), probs.shape[-1] - 1)


def uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), dtype=torch.float64, generator=generator))  # 53-bit: no float32 quantisation of u
