"""What one Locust run of `loadtest` measured, from its stats CSV: the one reader of those files
(the runner's side-by-side table and the docs' rendered tables use it)."""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModeFigures:
    requests: int
    failures: int
    output_tok_s: float  # requests/s x mean output tokens (the users report tokens as content size)
    ttft_p50_ms: float  # Locust rounds: 1 ms below 100 ms, 10 ms to 1 s
    tpot_p50_ms: float
    e2e_p50_ms: float


def read_stats(path: Path) -> dict[str, dict[str, str]]:
    """Locust's stats CSV: Type -> row (the mode's one Name per file)."""
    with path.open(newline="") as fh:
        return {row["Type"]: row for row in csv.DictReader(fh) if row["Name"] != "Aggregated"}


def mode_figures(out: Path, scenario: str, mode: str) -> ModeFigures | None:
    """The figures of `<scenario>_<mode>_stats.csv` under `out`; None when the run left none."""
    path = Path(out) / f"{scenario}_{mode}_stats.csv"
    if not path.is_file():
        return None
    stats = read_stats(path)
    request = next((stats[t] for t in ("gRPC", "HTTP") if t in stats), None)
    if request is None:
        return None
    nan = float("nan")
    return ModeFigures(int(request["Request Count"]), int(request["Failure Count"]),
                       float(request["Requests/s"]) * float(request["Average Content Size"]),
                       float(stats["TTFT"]["50%"]) if "TTFT" in stats else nan,
                       float(stats["TPOT"]["50%"]) if "TPOT" in stats else nan, float(request["50%"]))
