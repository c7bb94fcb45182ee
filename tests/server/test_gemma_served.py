"""Gemma 3 270M (the opt-in second target; make test-gemma) through the real Triton server,
served by `specdec serve --model gemma3-270m --eagle3-head models/eagle3-gemma3-270m`'s
settings: every method's greedy output equals the baseline's token for token, on prompts
short and longer than its 512-token sliding window (so the dynamic tree's nodes attend
windows of their own past it), and the trained head's drafts are accepted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec.tools.user_model import user_settings

pytestmark = [pytest.mark.gemma, pytest.mark.server]

GEMMA_HEAD = Path(__file__).resolve().parents[2] / "models" / "eagle3-gemma3-270m"
METHODS = ("ngram", "suffix", "eagle3", "eagle3-tree")


def test_every_method_equals_gemmas_baseline_past_its_window(gemma_dir, tmp_path):
    from transformers import AutoTokenizer

    from specdec.launcher.local import local_server
    from specdec_client import GenerateRequest, SpecDecClient

    tokenizer = AutoTokenizer.from_pretrained(str(gemma_dir))
    doc = (Path(__file__).resolve().parents[2] / "docs" / "methods.md").read_text()
    past_window = tokenizer.decode(tokenizer(doc, add_special_tokens=False).input_ids[:600])
    prompts = ("The three most important inventions of the twentieth century are", "def fibonacci(n):", past_window)
    settings = user_settings(gemma_dir, eagle3_head=GEMMA_HEAD)
    assert set(settings["methods"]) == set(METHODS)
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(settings))
    accepted = {method: 0 for method in METHODS}
    with local_server(tmp_path / "triton.log", path) as endpoints, SpecDecClient(endpoints.grpc, protocol="grpc", model="speculative_loop") as client:
        for prompt in prompts:
            plain = client.generate(GenerateRequest(prompt, max_tokens=48, num_draft_tokens=0, ignore_eos=True))
            assert len(plain.token_ids) == 48
            for method in METHODS:
                spec = client.generate(GenerateRequest(prompt, max_tokens=48, method=method, ignore_eos=True))
                assert spec.token_ids == plain.token_ids and spec.text == plain.text, (method, prompt[:40])
                accepted[method] += spec.perf.get("total_accepted_draft_tokens", 0)
    assert accepted["eagle3"] > 0 and accepted["eagle3-tree"] > 0, accepted
