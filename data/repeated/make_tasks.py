"""Writes tasks.jsonl: the repeated-task workload (issue 36), generated from a seed.

Agents and support bots ask the same few dozen kinds of task again and again, each time
with other names, numbers and tables. This file is that shape: TASKS templates, each filled
with seeded random values, in a seeded random order, so a user of the benchmark sees a
task's variations spread over the run (an earlier answer can teach a later one, as in
production; the first of each kind has nothing to learn from). Each line:
{"id", "task", "prompt", "max_tokens"}. Run:
    python data/repeated/make_tasks.py [--seed 0] [--count 240]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("tasks.jsonl")
MAX_TOKENS = 128

NAMES = ["Alice", "Bob", "Carlos", "Dana", "Emeka", "Fatima", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena"]
PRODUCTS = ["wireless mouse", "standing desk", "coffee grinder", "laptop stand", "noise-cancelling headphones",
            "electric kettle", "office chair", "USB-C hub", "water bottle", "backpack"]
TABLES = ["orders", "customers", "payments", "shipments", "tickets", "invoices", "sessions", "products"]
COLUMNS = ["created_at", "amount", "status", "country", "region", "plan", "channel", "category"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Denver", "Krakow", "Lima", "Hanoi", "Cork"]
LANGS = ["Python", "JavaScript", "Go", "Rust"]
VERBS = ["reverses a string", "checks whether a number is prime", "counts the vowels in a string",
         "returns the largest element of a list", "removes duplicates from a list", "computes a factorial"]

TASKS = {
    "sql_count": lambda r: f"Write a SQL query that counts the rows of the {r.choice(TABLES)} table grouped by "
                           f"{r.choice(COLUMNS)}, ordered by the count descending. Return only the SQL.",
    "sql_filter": lambda r: f"Write a SQL query that selects every column from {r.choice(TABLES)} where "
                            f"{r.choice(COLUMNS)} is '{r.choice(['active', 'pending', 'closed', 'EU', 'US'])}' and the "
                            f"amount is above {r.randint(10, 900)}. Return only the SQL.",
    "sql_join": lambda r: (lambda a, b: f"Write a SQL query that joins {a} and {b} on customer_id and returns the total "
                                        f"amount per customer for the last {r.randint(2, 12)} months. Return only the SQL.")(
        *r.sample(TABLES, 2)),
    "refund_reply": lambda r: f"Write a short, polite reply to {r.choice(NAMES)}, who asks for a refund for a "
                              f"{r.choice(PRODUCTS)} (order #{r.randint(10000, 99999)}) that arrived damaged. "
                              "Confirm the refund and say it takes 5 business days.",
    "delay_reply": lambda r: f"Write a short, polite reply to {r.choice(NAMES)}, whose {r.choice(PRODUCTS)} "
                             f"(order #{r.randint(10000, 99999)}) is delayed by {r.randint(2, 9)} days. Apologize and "
                             "give the new delivery estimate.",
    "password_reset": lambda r: f"Explain to {r.choice(NAMES)} in three numbered steps how to reset their password "
                                "on our website.",
    "func": lambda r: f"Write a {r.choice(LANGS)} function that {r.choice(VERBS)}. Return only the code.",
    "unit_test": lambda r: f"Write a Python unit test with pytest for a function that {r.choice(VERBS)}.",
    "weather_call": lambda r: f"Call the weather tool for {r.choice(CITIES)} on day {r.randint(1, 28)} of the month. "
                              'Answer only with JSON of the form {"tool": "get_weather", "city": ..., "day": ...}.',
    "email_summary": lambda r: f"Summarize in one sentence: '{r.choice(NAMES)} wrote that the {r.choice(PRODUCTS)} "
                               f"they bought in {r.choice(CITIES)} stopped working after {r.randint(2, 30)} days and "
                               "they would like a replacement.'",
    "classify": lambda r: f"Classify this support ticket as billing, shipping or technical, and answer with one word: "
                          f"'My {r.choice(PRODUCTS)} {r.choice(['was charged twice', 'has not arrived', 'does not turn on'])}.'",
    "translate": lambda r: f"Translate to French: 'Your order of a {r.choice(PRODUCTS)} has shipped and will arrive in "
                           f"{r.randint(2, 9)} days.'",
}


def generate(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    kinds = sorted(TASKS)
    rows = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        rows.append({"task": kind, "prompt": TASKS[kind](rng), "max_tokens": MAX_TOKENS})
    rng.shuffle(rows)
    return [{"id": f"r{i:04d}", **row} for i, row in enumerate(rows)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=240)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    rows = generate(args.seed, args.count)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} prompts of {len(TASKS)} tasks to {args.out}")


if __name__ == "__main__":
    main()
