"""Read the server's Prometheus metrics and diff counters between two scrapes: the benchmark
scrapes before and after each block of requests. The text format is parsed by
prometheus_client's parser; this module only indexes the samples by name and labels."""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families

from specdec_client.errors import ClientConnectionError

from specdec_wire import ACCEPTED_PER_POSITION_TOTAL as ACCEPTED_PER_POSITION
from specdec_wire import DRAFTED_PER_POSITION_TOTAL as DRAFTED_PER_POSITION

Samples = dict[tuple[str, frozenset], float]  # (sample name, {(label, value)}) -> value


def parse(text: str) -> Samples:
    """Every sample by its own name (a histogram's `_bucket` / `_sum` / `_count`, a counter's
    `_total`) and label set."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return parse(resp.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, OSError) as exc:
        raise ClientConnectionError(f"metrics {url}: {exc}") from exc


def by_label(samples: Samples, name: str, key: str, **match: str) -> dict[str, float]:
    """label `key` -> value of metric `name`, over samples whose labels include `match`."""
    out: dict[str, float] = {}
    wanted = set(match.items())
    for (sample_name, labels), value in samples.items():
        if sample_name != name or not wanted <= labels:
            continue
        label = dict(labels).get(key)
        if label is not None:
            out[label] = out.get(label, 0.0) + value
    return out


def delta(before: Samples, after: Samples) -> Samples:
    """after - before per series (a series absent before counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def positions(samples: Samples, name: str, method: str) -> dict[int, float]:
    """position -> value of a per-position counter for one method."""
    return {int(p): v for p, v in by_label(samples, name, "position", method=method).items() if p.isdigit()}


def per_position_counts(diff: Mapping, method: str) -> tuple[dict[int, float], dict[int, float]]:
    return positions(diff, DRAFTED_PER_POSITION, method), positions(diff, ACCEPTED_PER_POSITION, method)


def total(samples: Samples, name: str, **match: str) -> float:
    """Sum of metric `name` over the samples whose labels include `match` (0 when none)."""
    wanted = set(match.items())
    return sum(v for (sample_name, labels), v in samples.items() if sample_name == name and wanted <= labels)
