"""A request's logits rules (TensorRT-LLM's min_length, end_id, bad_words and the
repetition / presence / frequency penalties) applied to the target's logits at the root
and at every node of a draft tree, each row with the context that row would have when
decoding without speculation: the committed tokens plus the path from the root to it.

That is what keeps verification lossless: the target's distribution at every node is
exactly the one plain decoding would use at that position, so greedy picks the same
tokens and rejection sampling reproduces the same distribution. The drafters need not
know the rules (a draft the rules forbid is simply rejected).

Semantics (vLLM's and OpenAI's): the repetition penalty (CTRL, arXiv 1909.05858) divides
positive logits and multiplies negative ones of every token already in the prompt or the
output; the presence penalty subtracts a constant from, and the frequency penalty
subtracts its multiple of the count of, every token already in the output. A bad word
bans its last token wherever the context ends with the rest of it; before min_length
output tokens the end ids are banned. OpenAI's logit_bias adds its bias to its tokens at
every row. Penalties come first, then the biases, then the bans.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from specdec.config import LOGPROBS_RAW, SamplingParams
from specdec.engine.sampling import logits_to_probs
from specdec.engine.tree import DraftTree

BANNED = float("-inf")


def row_contexts(tree: DraftTree | None) -> list[list[int]]:
    """Row r's tokens beyond the committed context: [] for the root, the path's tokens for
    node r-1 (the tree's input rows are [root] + nodes)."""
    if tree is None:
        return [[]]
    return [[]] + [[tree.tokens[n] for n in tree.path_to(node)] for node in range(len(tree))]


def apply_rules(logits: Tensor, params: SamplingParams, prompt_len: int, context: Sequence[int],
                tree: DraftTree | None = None) -> Tensor:
    """[rows, V] logits -> processed copy. context: every token before the root row's
    prediction (prompt, then the output so far); prompt_len: how many of them are prompt.
    Row 0 predicts the token after `context`, row j+1 the token after tree node j."""
    if not params.shapes_logits:
        return logits
    logits = logits.float().clone()
    extras = row_contexts(tree)
    assert len(extras) == len(logits), f"{len(logits)} logit rows for {len(extras)} tree rows"
    if params.penalized:
        _penalize(logits, params, prompt_len, context, extras)
    if params.logit_bias:  # the same at every row: it depends on no context
        ids, biases = zip(*params.logit_bias)
        logits[:, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    generated = len(context) - prompt_len
    if params.min_length and params.end_ids:
        for r, extra in enumerate(extras):
            if generated + len(extra) < params.min_length:
                logits[r, list(params.end_ids)] = BANNED
    for word in params.bad_word_ids:
        *prefix, last = word
        for r, extra in enumerate(extras):
            if not prefix or _ends_with(context, extra, prefix):
                logits[r, last] = BANNED
    return logits


def _penalize(logits: Tensor, params: SamplingParams, prompt_len: int, context: Sequence[int],
              extras: list[list[int]]) -> None:
    """In place. Counts per row = the output's counts + the row's path (one small matrix)."""
    rows, vocab = logits.shape
    device = logits.device
    output = torch.as_tensor(list(context[prompt_len:]), dtype=torch.long, device=device)
    counts = torch.bincount(output, minlength=vocab).float().expand(rows, vocab).clone()
    for r, extra in enumerate(extras):
        if extra:
            counts[r].index_add_(0, torch.as_tensor(extra, device=device), torch.ones(len(extra), device=device))
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, torch.as_tensor(list(context[:prompt_len]), dtype=torch.long, device=device)] = True
        penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits.copy_(torch.where(seen, penalized, logits))
    if params.presence_penalty:
        logits -= params.presence_penalty * (counts > 0).float()
    if params.frequency_penalty:
        logits -= params.frequency_penalty * counts


def _ends_with(context: Sequence[int], extra: list[int], suffix: list[int]) -> bool:
    """Whether context + extra ends with suffix (without building the whole list)."""
    k = len(suffix)
    tail = list(context[max(0, len(context) - max(0, k - len(extra))):]) + extra
    return len(tail) >= k and tail[-k:] == suffix


# What a log prob of -inf travels as (vLLM's floor): JSON has no infinity.
LOG_PROB_FLOOR = -9999.0


@dataclass
class TokenLogProbs:
    """Per emitted token: its log prob, and with top_logprobs the likeliest tokens' (id, log prob)."""

    values: list[float] = field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] | None = None

    def __getitem__(self, part: slice) -> "TokenLogProbs":
        return TokenLogProbs(self.values[part], None if self.top is None else self.top[part])

    def extend(self, more: "TokenLogProbs") -> None:
        self.values.extend(more.values)
        if more.top is not None:
            self.top = (self.top or []) + list(more.top)

    def __len__(self) -> int:
        return len(self.values)

    @staticmethod
    def joined(parts: Sequence["TokenLogProbs | None"], counts: Sequence[int], width: int) -> "TokenLogProbs":
        """Rounds' log probs as one (a round without them: zeros, as TensorRT-LLM sends when
        none were asked for; alternatives it lacks: token 0 at the floor). counts: each round's tokens."""
        values, top = [], []
        for part, count in zip(parts, counts):
            part = part if part is not None else TokenLogProbs([0.0] * count)
            values += part.values
            top += part.top if part.top is not None else [((0, LOG_PROB_FLOOR),) * width] * count
        return TokenLogProbs(values, top if width else None)

    def top_tables(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The alternatives as [tokens, width] tensors: token ids (int32) and log probs (float32)."""
        table = np.asarray(self.top or [], dtype=np.float64).reshape(len(self.values), width, 2)
        return table[..., 0].astype(np.int32), table[..., 1].astype(np.float32)


def log_prob_rows(raw: Tensor, processed: Tensor, params: SamplingParams) -> Tensor:
    """[rows, V] log probs of the distribution params.logprobs_mode names (vLLM's modes):
    raw = the model's logits as they came; processed = the one tokens are drawn from (the
    rules and the grammar, then temperature, min_p, top-k and top-p: dropped tokens -inf);
    greedy is processed at temperature 1, untruncated (its choice is the argmax of those)."""
    if params.logprobs_mode == LOGPROBS_RAW:
        return torch.log_softmax(raw.float(), dim=-1)
    if params.greedy:
        return torch.log_softmax(processed.float(), dim=-1)
    tempered = processed.float() / params.temperature
    kept = logits_to_probs(processed, params) > 0  # the truncation, as sampling applies it
    return torch.log_softmax(tempered.masked_fill(~kept, float("-inf")), dim=-1)


def token_log_probs(raw: Tensor, processed: Tensor, params: SamplingParams, rows: Sequence[int],
                    tokens: Sequence[int]) -> TokenLogProbs:
    """log p(token) for each (row, token), with the top params.top_logprobs of each row; the
    same rows plain decoding computes, so speculation changes none of them (up to the
    kernels' batch-shape noise)."""
    if not tokens:  # a round that emits nothing (a guide's dead end); an empty index would be float
        return TokenLogProbs([], [] if params.top_logprobs else None)
    picked = list(rows)
    lp = log_prob_rows(raw[picked], processed[picked], params).clamp_min(LOG_PROB_FLOOR)
    values = lp[torch.arange(len(picked)), torch.as_tensor(list(tokens), dtype=torch.long)].tolist()
    if not params.top_logprobs:
        return TokenLogProbs(values)
    best = torch.topk(lp, params.top_logprobs, dim=-1)
    top = [tuple(zip(ids, lps)) for ids, lps in zip(best.indices.tolist(), best.values.tolist())]
    return TokenLogProbs(values, top)
