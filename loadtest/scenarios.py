"""Load test scenarios as pure stage plans (no Locust import, unit-tested).

- concurrency_1: one user sending requests back to back for the whole duration.
- production: ramp up in equal steps to N users (first quarter of the duration), hold N
  (middle half), ramp down in steps (last quarter), then stop.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

SCENARIOS = ("concurrency_1", "production")
DEFAULT_PRODUCTION_USERS = 16
DEFAULT_RAMP_STEPS = 4


@dataclass(frozen=True)
class Stage:
    until_s: float  # this stage lasts until this many seconds after the start
    users: int
    spawn_rate: float


def parse_duration(text: str | int | float) -> float:
    """'90', '90s', '2m', '1h30m' -> seconds (Locust's -t syntax)."""
    if isinstance(text, (int, float)):
        return float(text)
    total, number = 0.0, ""
    units = {"h": 3600, "m": 60, "s": 1}
    for ch in text.strip():
        if ch.isdigit() or ch == ".":
            number += ch
        elif ch in units and number:
            total += float(number) * units[ch]
            number = ""
        else:
            raise ValueError(f"duration: cannot parse {text!r} (use e.g. 90s, 2m, 1h30m)")
    if number:
        total += float(number)
    if total <= 0:
        raise ValueError(f"duration must be > 0, got {text!r}")
    return total


def plan(scenario: str, duration_s: float, users: int = DEFAULT_PRODUCTION_USERS,
         ramp_steps: int = DEFAULT_RAMP_STEPS) -> list[Stage]:
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    if scenario == "concurrency_1":
        return [Stage(duration_s, 1, 1.0)]
    if users < 1 or ramp_steps < 1:
        raise ValueError(f"production needs users >= 1 and ramp_steps >= 1, got {users}, {ramp_steps}")
    steps = min(ramp_steps, users)
    levels = [math.ceil(users * i / steps) for i in range(1, steps + 1)]  # ends at `users`
    rate = float(users)  # each step's users start within about a second
    ramp_end, hold_end = duration_s / 4, duration_s * 3 / 4
    stages = [Stage(ramp_end * (i + 1) / steps, n, rate) for i, n in enumerate(levels)]
    down = levels[-2::-1]  # the ramp-up levels below N, in reverse
    if not down:
        return stages + [Stage(duration_s, users, rate)]
    stages.append(Stage(hold_end, users, rate))
    span = duration_s - hold_end
    return stages + [Stage(hold_end + span * (i + 1) / len(down), n, rate) for i, n in enumerate(down)]


def tick(stages: list[Stage], run_time_s: float) -> tuple[int, float] | None:
    """(users, spawn_rate) at `run_time_s`, None once the plan is over (the test stops)."""
    for stage in stages:
        if run_time_s < stage.until_s:
            return stage.users, stage.spawn_rate
    return None


def mode(method: str | None, num_draft_tokens: str | int | None) -> tuple[str, str | None, int | None]:
    """(name, method, num_draft_tokens) of a load test run from its options: empty method =
    the server's default ("default"), empty num_draft_tokens = the method's configured
    budget, 0 = the baseline. The name is the Locust stats entry name."""
    method = method or None
    text = "" if num_draft_tokens is None else str(num_draft_tokens).strip()
    if text and not text.isdigit():
        raise ValueError(f"num_draft_tokens must be an integer >= 0, got {num_draft_tokens!r}")
    k = int(text) if text else None
    if k == 0:
        return "baseline", method, 0
    return (method or "default") + (f":{k}" if k is not None else ""), method, k


def prompt_order(count: int, seed: int, worker_index: int | None) -> list[int]:
    """Indices into the prompt list in the order one load generator sends them.

    A standalone run (worker_index None) keeps the data set's order. Each distributed worker
    gets its own permutation, seeded by (seed, worker_index): N workers that all started at
    prompt 0 would send the same prompt at the same moment, which batches identical
    sequences and flatters any prefix or prompt-lookup cache. Locust numbers its workers
    0..N-1 as they join, so a rerun with the same seed and worker count sends the same orders."""
    if count < 1:
        raise ValueError(f"prompt count must be >= 1, got {count}")
    order = list(range(count))
    if worker_index is None:
        return order
    if worker_index < 0:
        raise ValueError(f"worker_index must be >= 0, got {worker_index}")
    random.Random(f"{seed}:{worker_index}").shuffle(order)
    return order
