"""Chunked prefill: a prompt that arrives while another sequence decodes is prefilled in
chunks in the same forward as the running sequence's steps. The running sequence keeps
emitting meanwhile, and every output equals the one computed with whole-prompt prefill
(greedy identity), the EAGLE-3 head's drafts included (its prompt features come from the
chunks, concatenated). On float32 and on the int8 weights that ship (issue 61)."""
from __future__ import annotations

import pytest

from specdec.config import EngineConfig, SamplingParams, SpeculativeConfig
from specdec.serving.runtime import build_drafters, encode_prompt
from specdec.serving.spec_engine import SpecEngine

SHORT = "Write a haiku about autumn leaves."
LONG = ("Summarise the following notes for a newcomer to the team, keeping every number: " +
        " ".join(f"step {i}: the server restarted after {3 * i} minutes and {i + 2} requests were retried;" for i in range(12)))


def make_engine(model, tokenizer, chunk: int, max_slowdown: float = 2.5) -> SpecEngine:
    cfg = EngineConfig(max_batch_size=4, max_seq_len=1024, max_num_draft_tokens=8, prefill_chunk_tokens=chunk,
                       prefill_max_slowdown=max_slowdown)
    spec = {"eagle3": SpeculativeConfig(method="eagle3", max_draft_len=4),
            "ngram": SpeculativeConfig(method="ngram", max_draft_len=4, prompt_lookup_min=1, prompt_lookup_max=3)}
    return SpecEngine(model, cfg, tokenizer=tokenizer, drafters=build_drafters(model.cfg, spec, cfg, embed=model.embed))


def run_overlapped(engine: SpecEngine, short: list[int], long: list[int], method: str) -> tuple[dict, list[tuple[int, int]]]:
    """`short` decodes alone for 3 steps, then `long` joins. Returns the token ids of both and,
    per step after the join, (tokens `short` emitted, tokens `long` emitted)."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine.add_request("short", short, params, method)
    out = {"short": [], "long": []}
    for _ in range(3):
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    engine.add_request("long", long, params, method)
    steps = []
    while engine.has_work():
        emitted = {"short": 0, "long": 0}
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            emitted[o.request_id] += len(o.new_token_ids)
        steps.append((emitted["short"], emitted["long"]))
    return out, steps


@pytest.fixture(params=["smol_model", "smol_int8_model"], ids=["float32", "int8"])
def target(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("method", ["none", "ngram", "eagle3"])
def test_a_running_stream_keeps_emitting_while_a_long_prompt_is_prefilled(target, smol_tokenizer, method):
    smol_model = target
    short, long = encode_prompt(smol_tokenizer, SHORT), encode_prompt(smol_tokenizer, LONG)
    chunk = 48
    assert len(long) > 3 * chunk
    chunked = make_engine(smol_model, smol_tokenizer, chunk)
    out, steps = run_overlapped(chunked, short, long, method)
    whole = make_engine(smol_model, smol_tokenizer, 0)
    reference, whole_steps = run_overlapped(whole, short, long, method)
    assert out == reference  # greedy identity with whole-prompt prefill
    # while the long prompt's chunks run (no token of it yet), the short stream emits every step
    before_first = steps[: next(i for i, (_, n) in enumerate(steps) if n)]
    assert len(before_first) >= len(long) // chunk - 1
    assert all(n_short > 0 for n_short, _ in before_first), steps
    assert whole_steps[0][1] > 0  # without chunks the whole prompt went at once
    if method != "none":  # the same drafts were verified: the head saw the same prompt features
        assert chunked.stats.accepted_per_position == whole.stats.accepted_per_position


def test_chunked_prefill_through_the_loop_hooks(target, smol_tokenizer):
    """A START that does not finish its prompt answers no tokens; the caller's next steps
    continue it (what the Triton loop does), and its first token is the whole-prompt one."""
    from specdec.engine.speculator import StartItem, StepItem

    smol_model = target
    long = encode_prompt(smol_tokenizer, LONG)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = make_engine(smol_model, smol_tokenizer, 32, max_slowdown=0)  # chunks of 32 whatever the forwards cost
    spec = engine.speculator
    spec.prefill([StartItem("running", encode_prompt(smol_tokenizer, SHORT), SamplingParams(max_tokens=64))])
    first, steps = spec.run([StartItem("long", long, params, "eagle3", 4)], [StepItem("running")])
    assert first[0].emitted == [] and len(steps[0].emitted) == 1  # the chunk went beside the running step
    reply, calls = first[0], 1
    while not reply.emitted:  # the caller continues the prompt, one chunk per call beside the running step
        reply = spec.step([StepItem("long"), StepItem("running")])[0]
        calls += 1
    assert calls == -(-len(long) // 32)
    alone = make_engine(smol_model, smol_tokenizer, 0).speculator.prefill([StartItem("long", long, params, "eagle3", 4)])[0]
    assert reply.emitted == alone.emitted and reply.num_draft_tokens == alone.num_draft_tokens


def test_a_first_wave_streams_in_arrival_order_before_its_last_prompt_is_prefilled(target, smol_tokenizer):
    """Prompts arriving together with nothing decoding are chunked too (the first wave): the
    first prompt's first token comes in an earlier forward than the last's, prompts finish in
    the order they arrived, and every output equals whole-prompt prefill's."""
    prompts = [encode_prompt(smol_tokenizer, f"{SHORT} Then explain why, in {n} sentences.") for n in (2, 3, 4)]
    chunk = 32
    assert sum(map(len, prompts)) > 2 * chunk
    params = SamplingParams(max_tokens=12, ignore_eos=True)

    def wave(engine: SpecEngine) -> tuple[dict, dict]:
        for n, ids in enumerate(prompts):
            engine.add_request(str(n), ids, params)
        out, first_at, step = {str(n): [] for n in range(len(prompts))}, {}, 0
        while engine.has_work():
            step += 1
            for o in engine.step():
                if not out[o.request_id]:
                    first_at[o.request_id] = step
                out[o.request_id] += o.new_token_ids
        return out, first_at

    chunked, first_at = wave(make_engine(target, smol_tokenizer, chunk))
    whole, whole_first_at = wave(make_engine(target, smol_tokenizer, 0))
    assert chunked == whole
    assert set(whole_first_at.values()) == {1}  # whole prompts: the wave's first tokens all come from one forward
    order = [first_at[str(n)] for n in range(len(prompts))]
    assert order == sorted(order) and order[0] < order[-1], first_at
