"""`make soak`: production-shaped load with normal, cancelled and malformed requests for a
while, then a crash drill; reports what a reliability review asks for (not part of
`make test`).

    python -m loadtest.soak --minutes 30 --users 16 --out results/soak

Phase 0 (cancel storms): --cancels streams through `ensemble`, then through
`speculative_loop`, each cancelled after its first chunk: seconds until every slot is free,
memory before and after.

Phase 1 (soak): `--users` closed-loop users through `ensemble` (HTTP by default, see
--protocol), each request
drawn at random: 75% normal (a ShareGPT prompt, a random configured method or the
baseline, streamed to the end), 15% cancelled after their first chunk, 10% malformed (each
of the bad-input cases in turn, each of which must be refused with an error naming its
field). Every minute: requests, failures among well-formed requests, p50/p99 end-to-end
latency of the normal ones, and the server's resident memory (every process of its group,
stubs included; sampled every second, the peak reported too). At the end: the verifier's
slots must all be free again (specdec_active_sequences) and memory after warm-up must not
have grown > 5%.

Phase 1b (conversations, --conversations N): N two-turn conversations, --users at a time,
each turn sending the history with the model's own answer (the chat template rendered here)
under a cache_salt drawn from a pool (and some of their own), with the prefix cache and
the suffix method on (methods suffix, eagle3-hybrid, eagle3, the baseline in turn): no
failures, every turn after the first reuses cached KV, no slot held at the end, and the
server's memory after the first tenth flat (< 5% growth) while its prefix cache and suffix
corpus churn through their bounds.

Phase 2 (crash drill): kill the verifier's Python stub mid-stream; streams in flight must
end with an error (not hang) within --drill-timeout-s; then restart the server and check
that it serves again.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import psutil

from specdec_client import AsyncSpecDecClient, GenerateRequest, server_metrics
from specdec_client.envinfo import provenance, write_result
import specdec_wire as P

MALFORMED = [  # (what, request fields, the field its refusal must name)
    ("empty prompt", dict(prompt=""), P.TEXT_INPUT),
    ("max_tokens 0", dict(max_tokens=0), P.MAX_TOKENS),
    ("temperature < 0", dict(temperature=-1.0), P.TEMPERATURE),
    ("top_p > 1", dict(temperature=0.7, top_p=1.5), P.TOP_P),
    ("unknown method", dict(method="no-such-method"), P.SPECULATIVE_METHOD),
    ("draft tokens out of range", dict(num_draft_tokens=10_000), P.NUM_DRAFT_TOKENS),
]
RSS_EVERY_S = 1.0


def refusal_problem(what: str, field: str, error: BaseException | None) -> str | None:
    """What is wrong with the answer to a malformed request (None: refused, naming `field`)."""
    if error is None:
        return f"not refused: {what}"
    if field not in str(error):
        return f"refused without naming {field}: {what}: {str(error)[:200]}"
    return None


class PeakRss:
    """The highest resident memory `read()` returned (bytes), sampled every `every_s` by
    watch() while a phase runs: a spike between the per-minute samples is seen too."""

    def __init__(self, read):
        self.read = read
        self.peak = 0

    def sample(self) -> int:
        value = self.read()
        self.peak = max(self.peak, value)
        return value

    async def watch(self, every_s: float = RSS_EVERY_S) -> None:
        while True:
            self.sample()
            await asyncio.sleep(every_s)


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:  # gone since the listing
            pass
    return total


class Soak:
    def __init__(self, server, prompts: list[str], methods: list[str], args):
        self.server, self.prompts, self.methods, self.args = server, prompts, methods, args
        self.rng = random.Random(args.seed)
        self.minutes: list[dict] = []
        self._current: dict = {}
        self.rss = PeakRss(lambda: rss_bytes(self._pids()))

    def _new_minute(self) -> None:
        self._current = {"requests": 0, "normal": 0, "cancelled": 0, "malformed": 0, "failures": 0,
                         "malformed_not_refused": 0, "malformed_field_not_named": 0, "latencies_s": [], "errors": []}

    async def user(self, client, deadline: float) -> None:
        while time.monotonic() < deadline:
            kind = self.rng.choices(("normal", "cancelled", "malformed"), (75, 15, 10))[0]
            bucket = self._current
            bucket["requests"] += 1
            bucket[kind] += 1
            prompt = self.rng.choice(self.prompts)
            method = self.rng.choice(self.methods)
            base = dict(prompt=prompt, max_tokens=self.args.max_tokens, method=None if method == "baseline" else method,
                        num_draft_tokens=0 if method == "baseline" else None)
            try:
                if kind == "malformed":
                    what, fields, field = MALFORMED[bucket["malformed"] % len(MALFORMED)]
                    error = None
                    try:
                        await client.generate(GenerateRequest(**{**base, **fields}))
                    except Exception as exc:  # noqa: BLE001 - the expected answer
                        error = exc
                    problem = refusal_problem(what, field, error)
                    if problem:
                        bucket["malformed_not_refused" if error is None else "malformed_field_not_named"] += 1
                        bucket["errors"].append(problem)
                elif kind == "cancelled":
                    gen = client.stream(GenerateRequest(**base))
                    await gen.__anext__()
                    await gen.aclose()
                else:
                    t0 = time.monotonic()
                    await client.generate(GenerateRequest(**base))
                    bucket["latencies_s"].append(time.monotonic() - t0)
            except Exception as exc:  # noqa: BLE001 - counted, reported
                bucket["failures"] += 1
                bucket["errors"].append(f"{kind}: {str(exc)[:200]}")

    async def run(self) -> dict:
        url = _url(self.server, self.args.protocol)
        end = time.monotonic() + 60 * self.args.minutes
        clients = [AsyncSpecDecClient(url, self.args.protocol, timeout_s=self.args.request_timeout_s) for _ in range(self.args.users)]
        for c in clients:
            await c.__aenter__()
        watcher = asyncio.create_task(self.rss.watch())
        try:
            while time.monotonic() < end:
                self._new_minute()
                minute_end = min(end, time.monotonic() + 60)
                await asyncio.gather(*(self.user(c, minute_end) for c in clients))
                self.minutes.append(self._summarise(self._current))
                print(json.dumps(self.minutes[-1]), flush=True)
        finally:
            watcher.cancel()
            for c in clients:
                await c.__aexit__(None, None, None)
        return self._report()

    def _summarise(self, bucket: dict) -> dict:
        lat = bucket.pop("latencies_s")
        errors = bucket.pop("errors")
        return {**bucket, "minute": len(self.minutes) + 1,
                "e2e_p50_s": float(np.percentile(lat, 50)) if lat else None,
                "e2e_p99_s": float(np.percentile(lat, 99)) if lat else None,
                "rss_mib": self.rss.sample() / 2**20, "first_errors": errors[:3]}

    def _pids(self) -> list[int]:
        from specdec.launcher.processes import group_members

        return group_members(self.server.pgid)

    def _report(self) -> dict:
        deadline = time.monotonic() + 30
        active = self._active()
        while active and time.monotonic() < deadline:  # cancelled requests end at their next step
            time.sleep(0.5)
            active = self._active()
        rss = [m["rss_mib"] for m in self.minutes]
        warm = rss[1] if len(rss) > 1 else rss[0]
        return {
            "minutes": self.minutes,
            "well_formed_failures": sum(m["failures"] for m in self.minutes),
            "malformed_not_refused": sum(m["malformed_not_refused"] for m in self.minutes),
            "malformed_field_not_named": sum(m["malformed_field_not_named"] for m in self.minutes),
            "rss_peak_mib": self.rss.peak / 2**20,
            "active_sequences_at_end": active,
            "rss_growth_after_warmup": (rss[-1] - warm) / warm if warm else None,
            # A leak keeps growing; an allocator's high-water mark flattens: the second half alone.
            "rss_growth_second_half": (rss[-1] - rss[len(rss) // 2]) / rss[len(rss) // 2] if len(rss) > 3 else None,
        }

    def _active(self) -> float:
        samples = server_metrics.scrape(self.server.endpoints.metrics_url)
        return sum(server_metrics.by_label(samples, "specdec_active_sequences", "model").values())


CONVERSATION_METHODS = ("suffix", "eagle3-hybrid", "eagle3", "baseline")
SALT_POOL = 64  # salts shared by conversations; one in four conversations has a salt of its own


async def conversations(server, prompts: list[str], args) -> dict:
    """Phase 1b: args.conversations two-turn conversations; memory sampled as they go."""
    from specdec_client.datasets import chat_renderer

    render = chat_renderer()
    rng = random.Random(args.seed)
    rss = PeakRss(lambda: rss_bytes(group_members(server.pgid)))
    todo = list(range(args.conversations))
    out = {"conversations": 0, "turns": 0, "failures": 0, "second_turns_reusing_cache": 0, "errors": [], "rss_mib": []}
    sample_every = max(1, args.conversations // 10)

    async def one(client, n: int) -> None:
        salt = f"soak-{rng.randrange(SALT_POOL)}" if rng.random() < 0.75 else f"soak-own-{n}"
        method = CONVERSATION_METHODS[n % len(CONVERSATION_METHODS)]
        history = [{"role": "user", "content": rng.choice(prompts)[:400]}]
        for turn in range(2):
            request = GenerateRequest(render(history), max_tokens=args.conversation_tokens, apply_chat_template=False,
                                      cache_salt=salt, method=None if method == "baseline" else method,
                                      num_draft_tokens=0 if method == "baseline" else None)
            result = await client.generate(request)
            out["turns"] += 1
            if turn:
                out["second_turns_reusing_cache"] += int(result.perf.get(P.NUM_CACHED_TOKENS, 0) > 0)
            history += [{"role": "assistant", "content": result.text}, {"role": "user", "content": "Say more."}]

    async def user(client) -> None:
        while todo:
            n = todo.pop(0)
            try:
                await one(client, n)
            except Exception as exc:  # noqa: BLE001 - counted, reported
                out["failures"] += 1
                out["errors"].append(str(exc)[:200])
            out["conversations"] += 1
            if out["conversations"] % sample_every == 0:
                out["rss_mib"].append(rss.sample() / 2**20)

    clients = [AsyncSpecDecClient(_url(server, args.protocol), args.protocol, timeout_s=args.request_timeout_s)
               for _ in range(args.users)]
    t0 = time.monotonic()
    for c in clients:
        await c.__aenter__()
    try:
        await asyncio.gather(*(user(c) for c in clients))
    finally:
        for c in clients:
            await c.__aexit__(None, None, None)
    samples = server_metrics.scrape(server.endpoints.metrics_url)
    counters = {name: sum(v for (n, _), v in samples.items() if n == name)
                for name in (P.PREFIX_CACHE_QUERIES_TOTAL, P.PREFIX_CACHE_HITS_TOTAL)}
    warm = out["rss_mib"][0] if out["rss_mib"] else None
    out.update(seconds=time.monotonic() - t0, errors=out["errors"][:5], rss_peak_mib=rss.peak / 2**20,
               rss_growth_after_first_tenth=(out["rss_mib"][-1] - warm) / warm if warm else None,
               prefix_cache_hit_rate=counters[P.PREFIX_CACHE_HITS_TOTAL] / max(1.0, counters[P.PREFIX_CACHE_QUERIES_TOTAL]),
               active_sequences_at_end=sum(server_metrics.by_label(samples, "specdec_active_sequences", "model").values()))
    return out


def group_members(pgid: int) -> list[int]:
    from specdec.launcher.processes import group_members as members

    return members(pgid)


def _url(server, protocol: str) -> str:
    return server.endpoints.grpc if protocol == "grpc" else server.endpoints.http


async def cancel_storm(server, prompt: str, n: int, model: str, protocol: str) -> dict:
    """n streams through `model`, each cancelled after its first chunk: how long until every
    verifier slot is free again, and the server's memory before, after and at its peak."""
    from specdec.launcher.processes import group_members

    def active() -> float:
        samples = server_metrics.scrape(server.endpoints.metrics_url)
        return sum(server_metrics.by_label(samples, "specdec_active_sequences", "model").values())

    rss = PeakRss(lambda: rss_bytes(group_members(server.pgid)))
    rss_before = rss.sample()
    watcher = asyncio.create_task(rss.watch())

    async def one(client):
        gen = client.stream(GenerateRequest(prompt, max_tokens=256, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()

    try:
        async with AsyncSpecDecClient(_url(server, protocol), protocol, model=model) as client:
            for start in range(0, n, 16):  # 16 at a time: the verifier's slots
                await asyncio.gather(*(one(client) for _ in range(min(16, n - start))))
        last_cancel = time.monotonic()
        while active() and time.monotonic() - last_cancel < 120:
            await asyncio.sleep(0.2)
    finally:
        watcher.cancel()
    return {"model": model, "cancelled": n, "seconds_until_all_slots_free": time.monotonic() - last_cancel,
            "active_after": active(), "rss_before_mib": rss_before / 2**20,
            "rss_after_mib": rss.sample() / 2**20, "rss_peak_mib": rss.peak / 2**20}


async def crash_drill(server, prompt: str, args) -> dict:
    """Kill the verifier's stub (the `ensemble` model hosts it) while streams run: every stream
    must end (with an error)."""
    from specdec.launcher.processes import _proc_cmdline, group_members

    async def stream_once(client):
        t0 = time.monotonic()
        try:
            async for _ in client.stream(GenerateRequest(prompt, max_tokens=400, ignore_eos=True)):
                pass
            return {"outcome": "finished", "seconds": time.monotonic() - t0}
        except Exception as exc:  # noqa: BLE001 - the expected ending
            return {"outcome": "error", "seconds": time.monotonic() - t0, "error": str(exc)[:200]}

    stubs = [p for p in group_members(server.pgid) if "/ensemble/1/model.py" in _proc_cmdline(p)]
    async with AsyncSpecDecClient(_url(server, args.protocol), args.protocol, timeout_s=args.drill_timeout_s) as client:
        tasks = [asyncio.create_task(stream_once(client)) for _ in range(4)]
        await asyncio.sleep(3.0)
        for pid in stubs:
            os.kill(pid, signal.SIGKILL)
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks), args.drill_timeout_s + 30)
        except asyncio.TimeoutError:
            results = [{"outcome": "hung"}]
    return {"killed_stub_pids": stubs, "streams": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--request-timeout-s", type=float, default=300)
    p.add_argument("--drill-timeout-s", type=float, default=60)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--cancels", type=int, default=500, help="streams cancelled after their first chunk, per entry point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=1000, help="phase 1b: two-turn conversations (0: skip)")
    p.add_argument("--conversation-tokens", type=int, default=16, help="phase 1b: max_tokens per turn")
    p.add_argument("--only-conversations", action="store_true", help="run phase 1b alone (no cancel storms, soak or drill)")
    # Bundled Triton 2.51's gRPC frontend can abort on concurrent client cancellations
    # ("ASSERTION FAILED: prior > 0"; triton-inference-server/server#7368, fixed upstream in
    # a later release): soak the gRPC path on a server that has the fix.
    p.add_argument("--protocol", choices=("grpc", "http"), default="http")
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    args = p.parse_args(argv)

    from specdec.config import ServingConfig
    from specdec.tools.sharegpt import sharegpt_prompts
    from specdec.launcher import DEFAULT_MODEL_REPOSITORY, TritonServer, free_ports

    args.out.mkdir(parents=True, exist_ok=True)
    methods = ["baseline", *ServingConfig.from_file(DEFAULT_MODEL_REPOSITORY / "specdec.json").methods]
    prompts = sharegpt_prompts(args.num_prompts, seed=args.seed, max_tokens=256)
    started = provenance()
    report: dict = {"settings": vars(args) | {"out": str(args.out)}, "methods": methods}
    server = TritonServer(log_path=args.out / "triton.log")
    try:
        server.start(DEFAULT_MODEL_REPOSITORY, *free_ports(3))
        server.wait_ready(600)
        if args.conversations:
            report["conversations"] = asyncio.run(conversations(server, prompts, args))
            print(json.dumps({k: v for k, v in report["conversations"].items() if k != "rss_mib"}), flush=True)
        if args.only_conversations:
            return _conversation_verdict(report, args, started)
        report["cancel_storms"] = [asyncio.run(cancel_storm(server, prompts[1], args.cancels, model, args.protocol))
                                   for model in ("ensemble", "speculative_loop")]
        report["soak"] = asyncio.run(Soak(server, prompts, methods, args).run())
        report["crash_drill"] = asyncio.run(crash_drill(server, prompts[0], args))
    finally:
        server.stop()
    restarted = TritonServer(log_path=args.out / "triton-restart.log")
    try:
        restarted.start(DEFAULT_MODEL_REPOSITORY, *free_ports(3))
        restarted.wait_ready(600)

        async def one():
            async with AsyncSpecDecClient(_url(restarted, args.protocol), args.protocol) as client:
                return (await client.generate(GenerateRequest(prompts[0], max_tokens=8))).text

        report["serves_after_restart"] = bool(asyncio.run(one()))
    finally:
        restarted.stop()
    if args.conversations:
        report["verdict_conversations"] = _conversation_checks(report["conversations"])
    soak = report["soak"]
    report["rss_peak_mib"] = max([soak["rss_peak_mib"], *(c["rss_peak_mib"] for c in report["cancel_storms"])])
    report["verdict"] = {
        "no_well_formed_failures": soak["well_formed_failures"] == 0,
        "every_malformed_refused": soak["malformed_not_refused"] == 0,
        "every_refusal_names_the_field": soak["malformed_field_not_named"] == 0,
        "no_slot_held": soak["active_sequences_at_end"] == 0,
        "cancel_storms_drain_within_10s": all(c["active_after"] == 0 and c["seconds_until_all_slots_free"] < 10
                                              for c in report["cancel_storms"]),
        "rss_growth_below_5pct": soak["rss_growth_after_warmup"] is not None and soak["rss_growth_after_warmup"] < 0.05,
        "crash_drill_no_hang": all(s["outcome"] != "hung" for s in report["crash_drill"]["streams"]),
        "serves_after_restart": report["serves_after_restart"],
        **report.get("verdict_conversations", {}),
    }
    write_result(args.out / "soak.json", report, started)
    print(json.dumps(report["verdict"], indent=2))
    return 0 if all(report["verdict"].values()) else 1


def _conversation_checks(c: dict) -> dict:
    return {
        "conversations_no_failures": c["failures"] == 0,
        "conversations_second_turns_reuse_cache": c["second_turns_reusing_cache"] > 0.9 * (c["turns"] - c["conversations"]),
        "conversations_no_slot_held": c["active_sequences_at_end"] == 0,
        "conversations_rss_flat": c["rss_growth_after_first_tenth"] is not None and c["rss_growth_after_first_tenth"] < 0.05,
    }


def _conversation_verdict(report: dict, args, started: dict) -> int:
    report["verdict"] = _conversation_checks(report["conversations"])
    write_result(args.out / "conversations.json", report, started)
    print(json.dumps(report["verdict"], indent=2))
    return 0 if all(report["verdict"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
