"""Capture and head promotion through the real Triton server (issue 62).

One server, the served settings plus a capture store:
- capture: requests' tokens reach the store (the ones a salt keeps out do not), recorded by
  the verifier that served them;
- promotion: `promote_heads` (an admin request) swaps another EAGLE-3 head into the running
  engine while streams run (a head with other weights: the drafts change, the accepted
  count falls); every stream finishes whole, no request fails, and the greedy
  answers (during and after the swap, through every entry point) equal plain decoding's; a
  promotion without the admin key, or with a malformed body, is refused naming the field.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

import specdec_wire as P
from specdec.config import REPO_ROOT
from specdec_client import GenerateRequest, SpecDecClient, server_metrics

PROMPTS = ["Explain what a hash map is.", "Write a short poem about rain.", "def quicksort(xs):", "Name three rivers in Europe."]


@pytest.fixture(scope="module")
def capture_server(tmp_path_factory, smol_dir):
    from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
    from specdec.triton_models.keys import INTERNAL_KEY_ENV
    from tests.conftest import TEST_INTERNAL_KEY

    base = tmp_path_factory.mktemp("promote")
    settings = json.loads((DEFAULT_MODEL_REPOSITORY / "specdec.json").read_text())
    settings["engine"].update(max_seq_len=512, max_tokens_limit=512)
    settings["capture"] = {"directory": str(base / "captures"), "flush_after_s": 0.5, "shard_sequences": 64}
    # a head in the `drafter` model: the hidden states it is handed carry the capture's layer too
    settings["methods"]["eagle3-apart"] = {**settings["methods"]["eagle3"], "colocated": False}  # the same shape
    (base / "specdec.json").write_text(json.dumps(settings))
    http, grpc, metrics = free_ports(3)
    server = TritonServer(log_path=base / "triton.log")
    server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics, env={"SPECDEC_SETTINGS": str(base / "specdec.json"), INTERNAL_KEY_ENV: TEST_INTERNAL_KEY})
    try:
        server.wait_ready(timeout=300)
        yield server, base
    finally:
        server.stop()
    assert "Segfault encountered" not in server.log_path.read_text(errors="replace"), server.log_tail(60)


def greedy(prompt: str, method: str, max_tokens: int = 48, **kw) -> GenerateRequest:
    return GenerateRequest(prompt, max_tokens=max_tokens, temperature=0.0, method=method, ignore_eos=True, return_log_probs=False, **kw)


def accepted_tokens(server, method: str, prompts: list[str], max_tokens: int) -> tuple[float, list[str]]:
    """The draft tokens the server accepted for `method` over these greedy requests (one at a
    time, through the ensemble), and their texts."""
    before = server_metrics.by_label(server_metrics.scrape(server.endpoints.metrics_url), P.ACCEPTED_TOKENS_TOTAL, "method")
    with SpecDecClient(server.endpoints.grpc) as client:
        texts = [client.generate(greedy(p, method, max_tokens)).text for p in prompts]
    time.sleep(0.6)  # the verifier flushes its counters every 0.25 s
    after = server_metrics.by_label(server_metrics.scrape(server.endpoints.metrics_url), P.ACCEPTED_TOKENS_TOTAL, "method")
    return after.get(method, 0.0) - before.get(method, 0.0), texts


def other_head(source: Path, dest: Path) -> Path:
    """A head with other weights: the shipped one with its output rows rolled by one, so each
    draft names the next token of the draft vocabulary; its drafts are nearly all rejected."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(source, dest)
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        weights, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    weights["lm_head.weight"] = weights["lm_head.weight"].roll(1, dims=0).contiguous()
    save_file(weights, str(dest / "model.safetensors"), metadata=metadata)
    return dest


def test_served_requests_are_captured_and_salted_ones_kept_out(capture_server, smol_tokenizer):
    from specdec.serving.traffic_capture import read_captures
    from specdec.serving.runtime import encode_prompt

    server, base = capture_server
    with SpecDecClient(server.endpoints.grpc, model="speculative_loop") as client:  # the relay answers token ids
        answers = [client.generate(greedy(p, "eagle3", 16)) for p in PROMPTS[:2]]
        client.generate(greedy(PROMPTS[2], "eagle3", 16, cache_salt="tenant-x"))  # not named in the settings: never recorded
    # The head served apart drafts what the co-located one does (the same head, greedy): its
    # hidden states are the right columns although the verifier also taps the capture's layer.
    accepted = {method: accepted_tokens(server, method, PROMPTS[2:], 32)[0] for method in ("eagle3", "eagle3-apart")}
    assert accepted["eagle3"] > 0 and accepted["eagle3-apart"] == accepted["eagle3"], accepted
    deadline, recorded = time.monotonic() + 30, []
    while time.monotonic() < deadline and len(recorded) < 6:  # shards are written 0.5 s after their first sequence
        time.sleep(0.5)
        recorded = read_captures(base / "captures") if (base / "captures" / "capture.json").is_file() else []
    recorded = read_captures(base / "captures")
    # two prompts, then two more by two methods; the salted one never
    assert [s["method"] for s in recorded] == ["eagle3"] * 4 + ["eagle3-apart"] * 2, [s["method"] for s in recorded]
    assert all(s["salt"] is None for s in recorded)
    for prompt, answer, seq in zip(PROMPTS, answers, recorded):
        assert seq["tokens"].tolist() == (encode_prompt(smol_tokenizer, prompt) + answer.token_ids)[:-1]
        assert seq["taps"].shape == (len(seq["tokens"]), 3 * 576)


def test_a_promoted_head_serves_without_a_restart_and_fails_no_request(capture_server, monkeypatch, tmp_path):
    """Streams started with the old head finish with it while the new one is built and
    swapped in; the server names the head; greedy output equals plain decoding."""
    from specdec_client import ServerError

    server, _ = capture_server
    monkeypatch.setenv(P.ADMIN_KEY_ENV, "not-the-key")
    with SpecDecClient(server.endpoints.grpc) as client, pytest.raises(ServerError, match=P.ADMIN_KEY):
        client.promote_heads({"eagle3": str(REPO_ROOT / "models" / "eagle3-smollm2-135m")})
    monkeypatch.setenv(P.ADMIN_KEY_ENV, server.admin_key)
    with SpecDecClient(server.endpoints.grpc) as client:
        with pytest.raises(ServerError, match=P.HEAD_PARAMETERS["eagle3"]):
            client.promote_heads({"eagle3": str(tmp_path / "missing")})
        with pytest.raises(ServerError, match=f"{P.HEAD_PARAMETERS['eagle3']}.*does not load"):
            client.promote_heads({"eagle3": str(tmp_path)})  # a directory without a head
    head = other_head(REPO_ROOT / "models" / "eagle3-smollm2-135m", tmp_path / "eagle3-v2")
    with SpecDecClient(server.endpoints.grpc) as client:
        baseline = {p: client.generate(greedy(p, "none", 96)).text for p in PROMPTS}
    accepted_before, _ = accepted_tokens(server, "eagle3", PROMPTS[:2], 96)
    results, ended, errors, started = {}, {}, [], threading.Barrier(len(PROMPTS) + 1)

    def stream(prompt: str) -> None:
        try:
            with SpecDecClient(server.endpoints.grpc) as client:  # the ensemble: the engine's host itself
                text, first = [], True
                for chunk in client.stream(greedy(prompt, "eagle3", 96)):
                    text.append(chunk.text)
                    if first:
                        first = False
                        started.wait(60)
                results[prompt] = "".join(text)
                ended[prompt] = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{prompt!r}: {exc!r}")
            started.abort()

    threads = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    started.wait(120)  # every stream has its first tokens: the swap lands mid-stream
    with SpecDecClient(server.endpoints.grpc) as client:
        message = client.promote_heads({"eagle3": str(head)})
    promoted = time.monotonic()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert any(t > promoted for t in ended.values()), "every stream ended before the swap: it proved nothing"
    assert results == baseline
    assert message.startswith(f"promoted eagle3 {head} for eagle3") and "eagle3-hybrid" in message
    assert f"ensemble: {message}" in server.log_path.read_text(errors="replace")
    with SpecDecClient(server.endpoints.grpc) as client, SpecDecClient(server.endpoints.grpc, model="speculative_loop") as relay:
        assert client.health()["ready"]
        for p in PROMPTS[:2]:  # the new version, through the ensemble, a relay, and the head served apart
            assert client.generate(greedy(p, "eagle3", 96)).text == baseline[p]
            assert relay.generate(greedy(p, "eagle3-tree", 96)).text == baseline[p]
            assert client.generate(greedy(p, "eagle3-apart", 96)).text == baseline[p]
    # the swap changed the drafts (the new head's are nearly all rejected), not the answers
    accepted_after, texts = accepted_tokens(server, "eagle3", PROMPTS[:2], 96)
    assert texts == [baseline[p] for p in PROMPTS[:2]]
    assert accepted_after < accepted_before / 2, (accepted_before, accepted_after)
