"""Run by tests/client/test_loadtest.py in a subprocess (Locust monkey-patches the standard library
with gevent, which must not happen inside pytest): a real Locust master and WORKERS workers
in one process, connected over ZeroMQ on localhost, and the prompt order the locustfile gives
each worker once the master has numbered it. Prints {"indexes": [...], "orders": [[...], ...],
"standalone": [...]} as JSON.

    python tests/support/locust_workers_probe.py REPO_ROOT PROMPTS_JSONL WORKERS
"""
from __future__ import annotations

import json
import socket
import sys

sys.path.insert(0, sys.argv[1])
from loadtest import locustfile as L  # noqa: E402 - imports locust first, as Locust itself would

import gevent  # noqa: E402
from locust.argument_parser import get_parser  # noqa: E402
from locust.env import Environment  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(prompts_path: str, workers: int) -> dict:
    # Locust's own parser with the locustfile's options, as `locust -f loadtest/locustfile.py` parses them.
    options = get_parser(default_config_files=[]).parse_args(
        ["--specdec-dataset", "jsonl", "--specdec-dataset-path", prompts_path, "--specdec-num-prompts", "1000"])
    port = free_port()
    master = Environment(user_classes=[L.SpecDecUser], parsed_options=options)
    master.create_master_runner("127.0.0.1", port)
    envs = [Environment(user_classes=[L.SpecDecUser], parsed_options=options) for _ in range(workers)]
    for env in envs:
        env.create_worker_runner("127.0.0.1", port)
    for _ in range(500):  # each worker learns its index from the master's ack
        if all(env.runner.worker_index >= 0 for env in envs):
            break
        gevent.sleep(0.01)
    orders = [[p.text for p in L.ordered_prompts(env)] for env in envs]
    result = {"indexes": [env.runner.worker_index for env in envs], "orders": orders,
              "standalone": [p.text for p in L.ordered_prompts(master)]}
    for env in envs:
        env.runner.quit()
    master.runner.quit()
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[2], int(sys.argv[3]))))
