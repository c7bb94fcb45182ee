"""`specdec capture-cycle`: capture, train and promote on code traffic, measured (issue 62).

1. Code prompts: first-turn ShareGPT prompts that ask about code (training.data.code_prompts),
   without the benchmarks' prompts: --heldout of those the shipped head never trained on (not
   among its stored answers' prompts), never served before they are measured; --train others
   are the traffic.
2. A real Triton server (explicit model control) with capture on serves the traffic
   (greedy, the served default method, 4 streams); the store records it.
3. `specdec train-head` continues the shipped EAGLE-3 head on the captures (plus the ShareGPT
   conversations that measure it).
4. Held-out code prompts, in process on the served weight format: mean acceptance length
   (greedy, chain of 5) of the shipped head and of the new one.
5. Promotion: held-out prompts stream through the server while `promote_heads` swaps the
   new head in; every stream must finish, and every greedy answer equal plain decoding's.
Writes <out>/cycle.json and the server's log; the store and the head go to --work.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import specdec_wire as P
from specdec_client import GenerateRequest, SpecDecClient
from specdec_client.envinfo import provenance, write_result

from specdec.bench.head_acceptance import SHIPPED_HEAD
from specdec.config import SERVED_SETTINGS, EngineConfig, default_model_dir
from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports
from specdec.serving.runtime import encode_prompt, load_target, load_tokenizer
from specdec.training.data import answers_dir, code_prompts, load_answers
from specdec.training.heldout import heldout_acceptance

# The relay returns output_ids (the ensemble returns text only): answers are compared token for token.
RELAY = "speculative_loop"


# The measurement's requests (held-out prompts) carry a salt the capture does not name, so the
# store keeps the traffic alone and a later training run never sees a held-out prompt.
MEASURED_SALT = "capture-cycle-heldout"


def greedy(text: str, method: str | None, max_tokens: int, salt: str | None = MEASURED_SALT) -> GenerateRequest:
    return GenerateRequest(text, max_tokens=max_tokens, temperature=0.0, method=method, cache_salt=salt)


def client(url: str) -> SpecDecClient:
    return SpecDecClient(url, model=RELAY)


def serve_traffic(grpc: int, prompts: list[str], max_tokens: int, streams: int = 4) -> int:
    def one(text: str) -> int:
        with client(f"127.0.0.1:{grpc}") as c:
            return len(c.generate(greedy(text, None, max_tokens, salt=None)).token_ids)  # captured

    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        return sum(pool.map(one, prompts))


def promote_during_streams(server: TritonServer, grpc: int, head: Path, prompts: list[str], max_tokens: int) -> dict:
    """Stream the prompts (EAGLE-3 chain), swap the head in once all have first tokens, and
    compare every answer with plain decoding's (asked before the swap)."""
    url = f"127.0.0.1:{grpc}"
    with client(url) as c:
        plain = [c.generate(greedy(t, P.METHOD_NONE, max_tokens)).token_ids for t in prompts]
    if not all(plain):
        raise RuntimeError(f"{RELAY} returned no output_ids: nothing to compare")
    answers: dict[int, list[int]] = {}
    errors: list[str] = []
    first = threading.Barrier(len(prompts) + 1)

    def stream(i: int) -> None:
        try:
            ids, waited = [], False
            with client(url) as c:
                for chunk in c.stream(greedy(prompts[i], "eagle3", max_tokens)):
                    ids += chunk.token_ids
                    if not waited:
                        waited = True
                        first.wait(120)
            answers[i] = ids
        except Exception as exc:  # noqa: BLE001 - counted
            errors.append(repr(exc))
            first.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    first.wait(120)
    t0 = time.perf_counter()
    with SpecDecClient(url) as admin:
        admin.promote_heads({"eagle3": str(head)})
    swap_s = time.perf_counter() - t0
    for t in threads:
        t.join(600)
    with client(url) as c:
        after = [c.generate(greedy(t, "eagle3", max_tokens)).token_ids for t in prompts]
    return {"streams": len(prompts), "failed": len(errors), "errors": errors[:5], "promote_s": round(swap_s, 2),
            "identical_during_swap": sum(answers.get(i) == plain[i] for i in range(len(prompts))),
            "identical_after_swap": sum(a == p for a, p in zip(after, plain)),
            "log_names_the_head": f"promoted eagle3 {head}" in server.log_path.read_text(errors="replace")}


def run(args) -> dict:
    started = provenance()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(default_model_dir())
    # held out: code prompts the shipped head never trained on (not among its stored answers' prompts);
    # traffic: other code prompts (the shipped head may have seen those: a server's traffic is what it is)
    trained_on = {tuple(prompt) for _, prompt, _ in load_answers(answers_dir(192, 0))}
    held = code_prompts(tokenizer, args.heldout, args.seed, trained_on)
    if len(held) < args.heldout:
        raise SystemExit(f"only {len(held)} held-out code prompts")
    train = code_prompts(tokenizer, args.train, args.seed + 1, {tuple(encode_prompt(tokenizer, t)) for t in held})
    (out / "prompts.json").write_text(json.dumps({"train": train, "heldout": held}, indent=1))
    work = Path(args.work).resolve()  # the store and the head: large, never results/
    work.mkdir(parents=True, exist_ok=True)
    store, head = work / "captures", work / "head"
    settings = json.loads(SERVED_SETTINGS.read_text())
    settings["capture"] = {"directory": str(store), "flush_after_s": 2.0}
    (out / "specdec.json").write_text(json.dumps(settings, indent=1))
    record: dict = {"train_prompts": len(train), "heldout_prompts": len(held), "max_tokens": args.max_tokens, "seed": args.seed}
    http, grpc, metrics = free_ports(3)
    with TritonServer(log_path=out / "triton.log") as server:
        server.start(DEFAULT_MODEL_REPOSITORY, http_port=http, grpc_port=grpc, metrics_port=metrics, model_control_mode="explicit",
                     load_models=("*",), env={"SPECDEC_SETTINGS": str(out / "specdec.json")})
        server.wait_ready(timeout=600)
        import os

        os.environ[P.ADMIN_KEY_ENV] = server.admin_key
        if not args.skip_capture:
            t0 = time.perf_counter()
            record["traffic_tokens"] = serve_traffic(grpc, train, args.max_tokens)
            record["traffic_s"] = round(time.perf_counter() - t0, 1)
            time.sleep(5)  # the store's flush
        shards = sorted(store.glob("shard-*.npz"))
        record["store"] = {"shards": len(shards), "bytes": sum(p.stat().st_size for p in shards)}
        cmd = [str(Path(sys.executable).parent / "specdec"), "train-head", "--head", "eagle3", "--out", str(head),
               "--init-from", str(SHIPPED_HEAD), "--captures", str(store), "--conversations", str(args.conversations),
               "--max-len", "256", "--epochs", str(args.epochs), "--batch-size", "8", "--ttt-steps", "3", "--lr", str(args.lr),
               "--soft-labels", "--eval-prompts", "8", "--eval-tokens", "64"]
        if args.skip_train:  # the head already in <work>/head, as its own train_log says it was made
            record["train_command"] = json.loads((head / "train_log.json").read_text()).get("command")
        else:
            record["train_command"] = " ".join(cmd[1:])
            print("+", record["train_command"], flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True)
            record["train_s"] = round(time.perf_counter() - t0, 1)
        target = load_target(default_model_dir(), EngineConfig(weight_format="int8"))
        held_ids = [encode_prompt(tokenizer, t) for t in held]
        record["heldout_code"] = {name: heldout_acceptance(target, path, tokenizer, held_ids, args.max_tokens)
                                  for name, path in (("shipped", SHIPPED_HEAD), ("captured", head))}
        old, new = (record["heldout_code"][k]["mean_acceptance_length"] for k in ("shipped", "captured"))
        record["mal_gain"] = new / old - 1
        print(f"held-out code MAL: shipped {old:.3f}, trained on captures {new:.3f} ({100 * record['mal_gain']:+.1f}%)", flush=True)
        record["promotion"] = promote_during_streams(server, grpc, head, held[: args.promote_streams], args.max_tokens)
    write_result(out / "cycle.json", record, started)
    print(json.dumps({k: v for k, v in record.items() if k != "heldout_code"}, indent=1))
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="specdec capture-cycle", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/capture_cycle")
    p.add_argument("--train", type=int, default=240, help="code prompts served (and captured)")
    p.add_argument("--heldout", type=int, default=32, help="code prompts measured (never served before)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--conversations", type=int, default=200, help="ShareGPT conversations beside the captures (the held-out check's)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--promote-streams", type=int, default=4)
    p.add_argument("--work", default="tmp/capture-cycle", help="where the capture store and the trained head go")
    p.add_argument("--skip-capture", action="store_true", help="train on the store already in <work>/captures")
    p.add_argument("--skip-train", action="store_true", help="measure and promote the head already in <work>/head")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
