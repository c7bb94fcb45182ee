"""Log probs of emitted tokens in vLLM's two modes (specdec.engine.logits_processing):
raw = the model's distribution; processed = the one sampling draws from."""
import math

import torch

from specdec.config import LOGPROBS_RAW, SamplingParams
from specdec.engine.logits_processing import LOG_PROB_FLOOR, token_log_probs


def test_raw_and_processed_log_probs_with_their_alternatives():
    raw = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    processed = raw.clone()
    processed[:, 0] -= 1.5  # a rule moved token 0 (a presence penalty, say)
    params = SamplingParams(max_tokens=4, temperature=0.5, top_k=2, top_logprobs=3)
    out = token_log_probs(raw, processed, params, [0, 1], [1, 2])
    # processed: tempered, then only the top-2 kept (renormalized); the rest at the floor
    kept = torch.log_softmax(torch.tensor([1.0, 0.5]) / 0.5, dim=0)
    assert math.isclose(out.values[0], float(kept[0]), rel_tol=1e-6)
    assert [t for t, _ in out.top[0]][:2] == [1, 0] and out.top[0][2][1] == LOG_PROB_FLOOR
    assert math.isclose(sum(math.exp(lp) for _, lp in out.top[1][:2]), 1.0, rel_tol=1e-6)
    raw_out = token_log_probs(raw, processed, SamplingParams(max_tokens=4, temperature=0.5, top_k=2, logprobs_mode=LOGPROBS_RAW,
                                                             return_log_probs=True), [0, 1], [1, 2])
    assert raw_out.values == torch.log_softmax(raw, dim=-1)[[0, 1], [1, 2]].tolist() and raw_out.top is None
    # greedy: processed at temperature 1, untruncated
    greedy = token_log_probs(raw, processed, SamplingParams(max_tokens=4, temperature=0.0, top_k=2, return_log_probs=True), [1], [2])
    assert greedy.values == [float(torch.log_softmax(processed[1], dim=0)[2])]
    assert out[:1].values == out.values[:1] and len(out[:1].top) == 1


def test_rounds_join_into_the_tensors_the_verifier_sends():
    from specdec.engine.logits_processing import TokenLogProbs

    asked = TokenLogProbs([-0.5], [((3, -0.5), (7, -1.5))])
    joined = TokenLogProbs.joined([asked, None], [1, 2], 2)  # a round without log probs: zeros, alternatives at the floor
    assert joined.values == [-0.5, 0.0, 0.0]
    ids, values = joined.top_tables(2)
    assert ids.tolist() == [[3, 7], [0, 0], [0, 0]] and values.tolist() == [[-0.5, -1.5], [LOG_PROB_FLOOR] * 2, [LOG_PROB_FLOOR] * 2]
    assert TokenLogProbs.joined([], [], 2).top_tables(2)[0].shape == (0, 2)
