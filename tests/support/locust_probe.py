"""Run by tests/client/test_loadtest.py in a subprocess (Locust monkey-patches the standard library
with gevent, which must not happen inside pytest): drives the locustfile's SpecDecUser
with a scripted client and prints, as JSON, the request counts of Locust's own CSV files,
written by Locust's writer, and of a master's stats after a worker's report.

    python tests/support/locust_probe.py REPO_ROOT OUT_DIR REQUESTS
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1])
from loadtest import locustfile as L  # noqa: E402 - imports locust first, as Locust itself would

import gevent  # noqa: E402
from locust.env import Environment  # noqa: E402
from locust.event import Events  # noqa: E402
from locust.stats import (  # noqa: E402
    PERCENTILES_TO_REPORT, RequestStats, StatsCSVFileWriter, setup_distributed_stats_event_listeners,
)
from specdec_client.client import Chunk  # noqa: E402
from specdec_client.datasets import Prompt  # noqa: E402
from specdec_client.errors import ServerError  # noqa: E402

FAIL_EVERY = 4  # every 4th request fails with a server error
CHUNKS = (("a", {}), ("bcd", {}), ("e", {"output_tokens": 5, "verification_steps": 2}))  # 1, 3, 1 tokens


class ScriptedClient:
    def __init__(self):
        self.calls = 0

    def stream(self, request):
        self.calls += 1
        if self.calls % FAIL_EVERY == 0:
            raise ServerError("scripted failure")
        for text, perf in CHUNKS:
            yield Chunk(text, time.perf_counter(), perf)

    def close(self):
        pass


def counts(path: Path) -> dict[str, int]:
    with path.open() as fh:
        return {f"{row['Type']}|{row['Name']}": int(row["Request Count"]) for row in csv.DictReader(fh)}


def main(out: Path, requests: int) -> dict:
    env = Environment(user_classes=[L.SpecDecUser])
    env.parsed_options = argparse.Namespace(specdec_max_tokens=5, specdec_temperature=0.0, specdec_seed=0,
                                            specdec_ignore_eos="true", specdec_cache_salt="", specdec_turns=4)
    env.create_local_runner()  # subscribes the stats to request events, as in a real run
    user = L.SpecDecUser(env)
    user.client, user.protocol, user.prompts = ScriptedClient(), "grpc", [Prompt("hi", 5)]
    user.mode, user.method, user.k = "ngram", "ngram", None
    for _ in range(requests):
        user.generate()

    writer = StatsCSVFileWriter(env, PERCENTILES_TO_REPORT, str(out / "probe"), full_history=True)
    writing = gevent.spawn(writer)
    gevent.sleep(0.2)  # the writer writes and flushes every file on its first pass
    writing.kill()
    writer.close_files()
    with (out / "probe_stats_history.csv").open() as fh:
        history_types = sorted({row["Type"] for row in csv.DictReader(fh)})

    # distributed: a worker's report as the master adds it up
    worker_events, master_events, master = Events(), Events(), RequestStats()
    setup_distributed_stats_event_listeners(worker_events, env.stats)
    setup_distributed_stats_event_listeners(master_events, master)
    report: dict = {}
    worker_events.report_to_master.fire(client_id="worker", data=report)
    master_events.worker_report.fire(client_id="worker", data=report)
    return {"sent": user.client.calls, "stats_csv": counts(out / "probe_stats.csv"), "history_types": history_types,
            "master_total": master.total.num_requests, "master_failures": master.total.num_failures,
            "master_entries": {f"{e.method}|{e.name}": e.num_requests for e in master.entries.values()}}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[2]), int(sys.argv[3]))))
