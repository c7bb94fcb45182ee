"""`specdec readme-tables`: the README's results tables, rendered from the files under results/.

Each table in README.md (and docs/results.md) sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->` and is
rewritten from its source files by this command; nothing inside is edited by hand. Each ends
with a source line: the files, the commit that was measured, the date and the machine, as
the files record them. `--check` renders without writing and fails when the README differs
(tests/project/test_readme.py runs it, and fails on a figure outside a table as well).

A new benchmark run rewrites its summary; `make results` (or `make results-quick`) reruns
the benchmarks, then this command.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS_DOC = ROOT / "docs" / "results.md"
DOCUMENTS = (README, RESULTS_DOC)  # what `specdec readme-tables` renders by default
CITED = re.compile(r"`(results/[^`\s]+)`")
BLOCK = re.compile(r"(<!-- table:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table:(?P=name) -->)", re.S)


@dataclass
class Table:
    markdown: str
    sources: list[str]  # paths relative to the repository root


def read(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def provenance(path: str) -> tuple[str, str, str]:
    """(commit, date, machine) as the file records them: a benchmark summary under `env`,
    other tools at the top level or under `env`. The commit says "with local changes" when the
    tree was not clean, and "(tree state unknown)" when the file does not say (measured before the
    writer recorded it): never clean by default."""
    data = read(path)
    env = data.get("env") or {}
    commit = env.get("commit") or data.get("commit")
    date = env.get("date") or data.get("date")
    host = env.get("host") or data.get("host")
    if host:
        machine = f"{host['cpu_model']} x {host.get('cpus_usable') or host['cpu_count']}"
        if host.get("gpu_models"):
            machine += ", " + ", ".join(host["gpu_models"])
        if host.get("kernel_path"):
            machine += f", {host['kernel_path']} kernels"
    elif isinstance(data.get("machine"), str):
        machine = data["machine"]
    else:
        machine = f"{env.get('cpu', '?')} x {env.get('threads', '?')}"
    if not commit or not date:
        raise ValueError(f"{path} records no commit or date: rerun its benchmark (every result writes both)")
    dirty = commit.endswith("+dirty") or data.get("clean") is False or env.get("clean") is False or bool(data.get("uncommitted"))
    clean = data.get("clean") is True or env.get("clean") is True
    short = commit[:7] + (" with local changes" if dirty else "" if clean else " (tree state unknown)")
    return short, date[:10], machine


# Sources measured before a change that moves their figures, with the command that refreshes
# them: the table stays (it is what was measured) and says so.
INT8_DEFAULT = "the int8 weight default (float32 weights then)"
INT8_KERNELS = "the row-invariant int8 kernels (issue 59; PyTorch's int8 kernels then)"
HISTORY = {
    "results/identity/int8.json": (INT8_KERNELS, "make greedy-margin"),
    "results/identity/gguf.json": (INT8_KERNELS, "make greedy-margin"),
    "results/gemma/c1/summary.json": (INT8_KERNELS, "make bench-gemma"),
    "results/gemma/smollm2-c1/summary.json": (INT8_KERNELS, "make bench-gemma"),
    "results/bench/heads-greedy/summary.json": (f"in-flight batching (979e861), the v5 head and {INT8_DEFAULT}", "make bench-heads"),
    "results/bench/heads-t07/summary.json": (f"in-flight batching (979e861), the v5 head and {INT8_DEFAULT}", "make bench-heads"),
    "results/bench/v5-greedy/summary.json": (f"in-flight batching (979e861) and {INT8_DEFAULT}", "make bench-v5"),
    "results/bench/v5-t07/summary.json": (f"in-flight batching (979e861) and {INT8_DEFAULT}", "make bench-v5"),
    "results/bench/v5-t10/summary.json": (f"in-flight batching (979e861) and {INT8_DEFAULT}", "make bench-v5"),
    "results/bench/structured/summary.json": (INT8_DEFAULT, "make bench-structured"),
    "results/bench/conversations/summary.json": (INT8_DEFAULT, "make bench-conversations"),
    "results/bench/suffix/summary.json": (INT8_DEFAULT, "make bench-suffix"),
    "results/bench/load/closed_greedy/summary.json": (INT8_DEFAULT, "make bench-load-sweep"),
}


def source_line(paths: list[str], to_root: str = "") -> str:
    """to_root: the links' way from the document to the repository root ("../" from docs/)."""
    parts = []
    for path in paths:
        commit, date, machine = recorded_or_unknown(path)
        said = f"commit {commit}, {date}, {machine}" if commit != "unknown" else "commit, date and machine unknown: not recorded"
        parts.append(f"[`{path}`]({to_root}{path}) ({said})")
    line = "Source: " + "; ".join(parts) + "."
    stale = {HISTORY[p] for p in paths if p in HISTORY}
    for before, command in sorted(stale):
        line += f" History: measured before {before}; `{command}` refreshes it."
    return line


# --- benchmark summaries (specdec-client bench, schema 2) ---

def summary_index(path: str) -> tuple[dict, dict, dict]:
    """(runs, speedups, summary) with runs and speedups keyed by (mode, load)."""
    s = read(path)
    runs = {(r["mode"], r["load"]): r for r in s["runs"]}
    speedups = {(r["mode"], r["load"]): r for r in s["speedup"]}
    return runs, speedups, s


def modes_of(runs: dict, load: str) -> list[str]:
    return [mode for mode, at in runs if at == load and mode != "baseline"]


def ratio(entry: dict, blocks: bool = True, bold: bool = False) -> str:
    text = f"{entry['output_tok_s_ratio']:.2f}x"
    text = f"**{text}**" if bold else text
    gains = entry.get("block_gains") or []
    if blocks and len(gains) > 1:
        text += f" ({min(gains):.2f}-{max(gains):.2f})"
    return text


def accept_len(run: dict) -> str:
    value = run.get("mean_acceptance_length")
    return "-" if value is None else f"{value:.2f}"


def noted(mode: str, notes: dict[str, str], bold: bool = False) -> str:
    """A mode's label with its note ("suffix (ours)"), the mode's own name bold when it won."""
    name, _, note = notes.get(mode, mode).partition(" ")
    return " ".join(filter(None, [f"**{name}**" if bold else name, note]))


def mode_cell(mode: str, best: str | None) -> str:
    return f"**{mode}**" if mode == best else mode


def best_mode(speedups: dict, load: str) -> str | None:
    at = [(e["output_tok_s_ratio"], mode) for (mode, lo), e in speedups.items() if lo == load]
    return max(at)[1] if at else None


def lossless_line(summary: dict) -> str:
    check = summary.get("lossless") or {}
    if not check.get("greedy"):
        return ""
    return f"{check['identical']:,} of {check['compared']:,} greedy speculative outputs identical to the baseline's."


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def by_ratio(speedups: dict, modes: list[str], load: str) -> list[str]:
    return sorted(modes, key=lambda m: -speedups[(m, load)]["output_tok_s_ratio"])


def structured(path: str = "results/bench/structured/summary.json", checked: str = "validate against their schema") -> Table:
    runs, speedups, s = summary_index(path)
    load = "c=1"
    base = runs[("baseline", load)]
    rows = [["baseline", f"{base['output_tok_s']:.1f} tok/s", f"{base['tpot_ms']['p50']:.0f} ms", "-", "-"]]
    best = best_mode(speedups, load)
    for mode in by_ratio(speedups, modes_of(runs, load), load):
        run, sp = runs[(mode, load)], speedups[(mode, load)]
        rows.append([mode_cell(mode, best), ratio(sp, bold=mode == best), f"{sp['tpot_p50_ratio']:.2f}x",
                     accept_len(run), f"{run['accepted_tokens']:,} ({run['forced_accepted_tokens']:,})"])
    valid = sorted({f"{r['structured']['valid']} of {r['structured']['checked']}" for r in runs.values() if r.get("structured")})
    text = table(["mode (x constrained baseline)", "output tok/s (blocks)", "TPOT p50", "accept len",
                  "accepted drafts (forced by the grammar)"], rows)
    text += f"\n\n{lossless_line(s)} Outputs that {checked}, per mode: {', '.join(valid)}."
    return Table(text, [path])


def conversations() -> Table:
    path = "results/bench/conversations/summary.json"
    runs, speedups, s = summary_index(path)
    load = "c=1"
    last = max(t["turn"] for t in runs[("baseline", load)]["by_turn"])

    def last_turn(mode: str) -> dict:
        return next(t for t in runs[(mode, load)]["by_turn"] if t["turn"] == last)

    rows = []
    for mode in ["baseline"] + [m for m in modes_of(runs, load) if not m.endswith("/no-cache")]:
        cached, fresh = last_turn(mode), last_turn(f"{mode}/no-cache")
        ttft = f"{cached['ttft_ms']['p50']:.0f} / {fresh['ttft_ms']['p50']:.0f} ms ({cached['ttft_ms']['p50'] / fresh['ttft_ms']['p50']:.2f}x)"
        speed = "1.00" if mode == "baseline" else ratio(speedups[(mode, load)], blocks=False)
        accept = "1.00" if mode == "baseline" else f"{cached['mean_acceptance_length']:.2f} / {fresh['mean_acceptance_length']:.2f}"
        rows.append([mode, ttft, speed, accept])
    text = table(["mode", f"TTFT p50, turn {last + 1}: cache / none", "output tok/s x baseline (cache on)",
                  f"accept len, turn {last + 1}: cache / none"], rows)
    text += f"\n\n{lossless_line(s)}"
    return Table(text, [path])


def suffix() -> Table:
    path = "results/bench/suffix/summary.json"
    runs, speedups, s = summary_index(path)
    load = "c=1"
    best = best_mode(speedups, load)
    rows = [[mode_cell(m, best), ratio(speedups[(m, load)], bold=m == best), accept_len(runs[(m, load)])]
            for m in by_ratio(speedups, modes_of(runs, load), load)]
    base = runs[("baseline", load)]["output_tok_s"]
    text = table([f"mode (x baseline, {base:.1f} tok/s)", "output tok/s (blocks)", "accept len"], rows)
    text += f"\n\n{lossless_line(s)}"
    return Table(text, [path])


def by_concurrency(path: str, modes: list[str] | None = None, blocks: bool = True, acceptance: bool = False) -> Table:
    """Every mode x every load of a closed-loop sweep: the baseline's tok/s, then ratios (and,
    with acceptance, each mode's mean acceptance length per load)."""
    runs, speedups, s = summary_index(path)
    loads = sorted({load for _, load in runs}, key=lambda lo: int(lo.split("=")[1]))
    modes = modes or list(dict.fromkeys(m for m, _ in runs if m != "baseline"))
    best = {load: best_mode(speedups, load) for load in loads}
    rows = [["baseline tok/s"] + [f"{runs[('baseline', lo)]['output_tok_s']:.1f}" for lo in loads]]
    for mode in modes:
        rows.append([mode] + [ratio(speedups[(mode, lo)], blocks, bold=best[lo] == mode) for lo in loads])
    if acceptance:
        rows.append([f"mean acceptance length: {', '.join(modes)}"]
                    + [", ".join(accept_len(runs[(mode, lo)]) for mode in modes) for lo in loads])
    text = table(["mode"] + loads, rows) + f"\n\n{lossless_line(s)}"
    return Table(text, [path])


def in_flight() -> Table:
    path = "results/bench/load/in_flight.json"
    data = read(path)
    points: dict[tuple[int, str], list[dict]] = {}
    for p in data["points"]:
        points.setdefault((p["concurrency"], p["mode"]), []).append(p)
    loads = sorted({c for c, _ in points})
    modes = [m for m in dict.fromkeys(m for _, m in points) if m != "baseline"]

    def each(c: int, mode: str, value: Callable[[dict], float], fmt: str) -> str:
        return ", ".join(format(value(p), fmt) for p in sorted(points[(c, mode)], key=lambda p: p["block"]))

    def gain(c: int, mode: str) -> str:
        base = {p["block"]: p["triton"]["output_tok_s"] for p in points[(c, "baseline")]}
        return ", ".join(f"{p['triton']['output_tok_s'] / base[p['block']]:.2f}" for p in sorted(points[(c, mode)], key=lambda p: p["block"]))

    rows = [
        ["Triton baseline, output tok/s"] + [each(c, "baseline", lambda p: p["triton"]["output_tok_s"], ".1f") for c in loads],
        ["in-process baseline, output tok/s"] + [each(c, "baseline", lambda p: p["in_process"]["output_tok_s"], ".1f") for c in loads],
    ]
    rows += [[f"Triton / in-process engine ({mode})"] + [each(c, mode, lambda p: p["triton_over_in_process"], ".2f") for c in loads]
             for mode in ["baseline", *modes]]
    rows += [
        ["streams per target forward (median)"] + [each(c, "baseline", lambda p: p["triton"]["median_batch_sequences"], ".0f") for c in loads],
        ["TTFT p50, Triton baseline (ms)"] + [each(c, "baseline", lambda p: p["triton"]["ttft_p50_ms"], ".0f") for c in loads],
    ]
    if all("ttft_p50_ms" in p["in_process"] for p in data["points"]):  # recorded since issue 60
        rows.append(["TTFT p50, in-process baseline (ms)"]
                    + [each(c, "baseline", lambda p: p["in_process"]["ttft_p50_ms"], ".0f") for c in loads])
    rows += [[f"{mode} / baseline, Triton"] + [gain(c, mode) for c in loads] for mode in modes]
    rows.append(["benchmark client's CPU share"] + [each(c, "baseline", lambda p: 100 * p["triton"]["client_cpu_share"], ".1f") + " %" for c in loads])
    return Table(table(["", *(f"c={c}" for c in loads)], rows), [path])


def ttft_by_length() -> Table:
    path = "results/bench/load/in_flight.json"
    rows = [[str(r["prompt_tokens"]), f"{r['triton_ttft_p50_ms']:.0f}", f"{r['in_process_ttft_p50_ms']:.0f}",
             f"{r['triton_over_in_process']:.2f}"] for r in read(path)["ttft_by_prompt_length"]]
    return Table(table(["prompt tokens", "TTFT p50, Triton (ms)", "in process (ms)", "Triton / in process"], rows), [path])


def heads() -> Table:
    paths = ["results/bench/heads-greedy/summary.json", "results/bench/heads-t07/summary.json"]
    (g_runs, g_sp, _), (t_runs, t_sp, _) = summary_index(paths[0]), summary_index(paths[1])
    loads = sorted({lo for _, lo in g_runs}, key=lambda lo: int(lo.split("=")[1]))

    def cells(speedups: dict, mode: str) -> str:
        return " / ".join(f"{speedups[(mode, lo)]['output_tok_s_ratio']:.2f}" if (mode, lo) in speedups else "-" for lo in loads)

    rows = [[mode, cells(g_sp, mode), cells(t_sp, mode)] for mode in modes_of(g_runs, loads[0])]
    return Table(table(["method", f"greedy, {' / '.join(loads)}", f"T=0.7, {' / '.join(loads)}"], rows), paths)


def head_acceptance() -> Table:
    """Each EAGLE-3 head version per workload (make bench-head-acceptance): greedy mean acceptance
    length as a chain and as the served tree, and c=1 speed against plain decoding beside it."""
    path = "results/heads/summary.json"
    record = read(path)
    measured = {r["head"] for r in record["rows"]}
    # The capture cycle's head lives in tmp/ (made by `make capture-cycle`, ~40 min): its last
    # measurement stays in the table, from its own run, when the latest run had no such head
    # (that run's `shipped` was v5, which the latest run measures again as `v5`)
    earlier_path = "results/heads/capture-cycle/summary.json"
    earlier = [r for r in read(earlier_path)["rows"] if r["head"] not in measured | {"shipped"}]
    rows = []
    for r in record["rows"] + earlier:
        chain, tree = r["chain"], r["tree"]
        rows.append([r["head"], r["workload"], str(r["prompts"]), f"{chain['mean_acceptance_length']:.2f}", f"{tree['mean_acceptance_length']:.2f}",
                     f"{chain['speedup_c1']:.2f}", f"{tree['speedup_c1']:.2f}",
                     ", ".join(f"{a:.2f}" for a in chain["per_position_acceptance"])])
    header = ["head", "workload", "prompts", "MAL chain (K=5)", "MAL tree", "c=1 x plain, chain", "c=1 x plain, tree",
              "chain acceptance by position"]
    return Table(table(header, rows), [path] + ([earlier_path] if earlier else []))


def tree_shapes() -> Table:
    """EAGLE-3 chain and tree shapes against the measured verify cost (make bench-tree-shapes),
    per head weight dtype (runs before 2026-12-06's int8 drafts were bfloat16 only)."""
    path = "results/tree_shapes/summary.json"
    rows = [[r["shape"], r.get("draft_dtype", "bfloat16"), f"{r['mean_acceptance_length']:.2f}", f"{r['rows_per_step']:.1f}",
             f"{r['tokens_per_row']:.2f}", f"{r['tok_s']:.1f}", f"{r['plain_tok_s']:.1f}", f"{r['speedup_c1']:.2f}"]
            for r in read(path)["rows"]]
    header = ["shape", "head weights", "MAL", "rows verified per step", "tokens per row", "tok/s", "plain tok/s beside it", "c=1 x plain"]
    return Table(table(header, rows), [path])


def served_shapes() -> Table:
    """EAGLE-3 shapes through Triton at c=1 and c=4 (the served defaults' evidence): each mode's
    aggregate output tok/s over the baseline (paired blocks) and its mean acceptance length."""
    path = "results/tree_shapes/served/summary.json"
    runs, speedups, summary = summary_index(path)
    shapes = summary["env"]["server_config"]["speculative"]["methods"]
    rows = []
    for mode in modes_of(runs, "c=1"):
        spec = shapes.get(mode, {})
        shape = (f"tree d={spec.get('max_draft_len')} k={spec.get('dynamic_tree_max_topK')} n={spec.get('max_total_draft_tokens')}"
                 if spec.get("use_dynamic_tree") else f"chain K={spec.get('max_draft_len')}")
        if spec.get("adaptive"):
            shape = "planned" + (", n-gram + suffix merged" if spec.get("hybrid_ngram") else "")
        rows.append([mode, shape, *(f"{ratio(speedups[(mode, load)])} ({accept_len(runs[(mode, load)])})"
                                    if (mode, load) in speedups else "" for load in ("c=1", "c=4"))])
    return Table(table(["mode", "shape", "c=1 x baseline (accept len)", "c=4 x baseline (accept len)"], rows), [path])


V5_LABELS = {"eagle3": "eagle3 (K=5)", "eagle3-tree": "eagle3-tree, top-k tree at T > 0",
             "eagle3-tree-sampled": "eagle3-tree, sampled tree at T > 0 (now shipped)"}


def v5(detail: bool = False) -> Table:
    """EAGLE-3 v5's served modes per temperature (x baseline, acceptance length); detail: with
    each ratio's block range, the modes' labels and the best per temperature in bold."""
    paths = {"greedy": "results/bench/v5-greedy/summary.json", "T=0.7": "results/bench/v5-t07/summary.json",
             "T=1.0": "results/bench/v5-t10/summary.json"}
    indexed = {name: summary_index(path) for name, path in paths.items()}
    best = {name: best_mode(speedups, "c=1") for name, (_, speedups, _) in indexed.items()}

    def cell(name: str, runs: dict, speedups: dict, mode: str) -> str:
        entry = speedups.get((mode, "c=1"))
        if entry is None:
            return ""
        value, accepted = f"{entry['output_tok_s_ratio']:.2f}", accept_len(runs[(mode, "c=1")])
        if not detail:
            return f"{value} ({accepted})"
        gains = entry["block_gains"]
        return f"{f'**{value}**' if best[name] == mode else value} ({min(gains):.2f}-{max(gains):.2f}; {accepted})"

    modes = dict.fromkeys(m for runs, _, _ in indexed.values() for m in modes_of(runs, "c=1"))
    rows = [[V5_LABELS.get(mode, mode) if detail else mode]
            + [cell(name, runs, speedups, mode) for name, (runs, speedups, _) in indexed.items()] for mode in modes]
    header = "method" if detail else "method (x baseline, accept len)"
    return Table(table([header, *paths], rows), list(paths.values()))


def second_model(blocks: bool = False) -> Table:
    """Gemma 3 270M beside SmolLM2 (make bench-gemma): the same methods, prompts and lengths at
    c=1, each model against its own baseline on its own server (prefix cache off: the modes
    are named `<method>/no-cache`, shown by method); blocks: each ratio's block range too."""
    paths = {"Gemma 3 270M": "results/gemma/c1/summary.json", "SmolLM2-135M": "results/gemma/smollm2-c1/summary.json"}
    indexed = {}
    for name, path in paths.items():
        runs, speedups, s = summary_index(path)
        indexed[name] = ({(m.split("/")[0], lo): r for (m, lo), r in runs.items()},
                         {(m.split("/")[0], lo): e for (m, lo), e in speedups.items()}, s)
    rows = [["baseline tok/s"] + [f"{runs[('baseline', 'c=1')]['output_tok_s']:.1f}" for runs, _, _ in indexed.values()]]
    def cell(runs: dict, speedups: dict, mode: str) -> str:
        entry = speedups.get((mode, "c=1"))
        if entry is None:
            return "-"
        gains = entry.get("block_gains") or []
        spread = f", blocks {min(gains):.2f}-{max(gains):.2f}" if blocks and gains else ""
        return f"{ratio(entry, blocks=False)} ({accept_len(runs[(mode, 'c=1')])}){spread}"

    for mode in dict.fromkeys(m for runs, _, _ in indexed.values() for m in modes_of(runs, "c=1")):
        rows.append([mode] + [cell(runs, speedups, mode) for runs, speedups, _ in indexed.values()])
    lossless = " ".join(f"{name}: {lossless_line(s)}" for name, (_, _, s) in indexed.items())
    return Table(table(["method (x its baseline, accept len), c=1", *paths], rows) + f"\n\n{lossless}", list(paths.values()))


def greedy_margin() -> Table:
    paths = [f"results/identity/{name}.json" for name in ("float32", "bfloat16", "int8", "gguf")]
    rows = []
    for path in paths:
        data = read(path)
        margin = data["baseline"]["margin"]
        for method, m in data["methods"].items():
            rows.append([data.get("weight_format") or data["dtype"], method, f"{m['identical']} of {m['of']}", f"{margin['min']:.1e}",
                         f"{m['distance']['max']:.1e}", f"{m['flippable_rows']:,} of {m['compared_rows']:,}"])
    header = ["weights", "method", "outputs identical to the baseline", "smallest baseline margin (logits)",
              "largest logit distance (verify row vs decode row)", "rows where 2 x distance >= margin"]
    return Table(table(header, rows), paths)


def weight_formats() -> Table:
    path = "results/quantized/formats.json"
    data = read(path)
    rows = [[name, f"{r['streamed_bytes'] / 1e6:,.0f}", f"{r['floor_tok_s']:,.0f}", f"{r['c1_per_user_tok_s']:.1f}",
             f"{r['c1_of_floor']:.2f}", f"{r['c16_aggregate_tok_s']:,.1f}", f"{r['forward_ms']['b1_k1']:.1f}",
             f"{r['forward_ms']['b1_k16']:.1f}" if "b1_k16" in r["forward_ms"] else "-",
             f"{r['forward_ms']['b16_k1']:.1f}"] for name, r in data["formats"].items()]
    header = ["weights", "MB read per step", "streaming floor (tok/s)", "c=1 tok/s", "of floor", "c=16 aggregate tok/s",
              "forward, 1 row (ms)", "forward, a 16-row tree (ms)", "forward, 16 sequences x 1 row (ms)"]
    return Table(table(header, rows), [path])


def verify_cost() -> Table:
    """The whole int8 / gguf forward against rows verified, this tree and the commit before the
    kernels, side by side in one run (python -m specdec.bench.experiments.kernels.forward_vs_commit)."""
    path = "results/kernels/forward_vs_2e7831c.json"
    data = read(path)
    rows = []
    for name, r in data["formats"].items():
        for tree in ("before", "after"):
            ms = r["forward_ms"][tree]
            label = f"{name}, {data['before'] if tree == 'before' else 'the row-invariant kernels'}"
            rows.append([label, *(f"{ms[k]:.1f}" for k in ("1", "2", "4", "8", "16", "32", "b16_k1")),
                         f"{ms['16'] / ms['1']:.2f}"])
    header = ["weights, kernels", "1 row (ms)", "2", "4", "8", "16", "32", "16 sequences x 1 row", "16 rows / 1 row"]
    return Table(table(header, rows), [path])


def format_quality() -> Table:
    """Each quantized format's next-token distribution against float32 (specdec format-quality)."""
    path = "results/quantized/quality.json"
    data = read(path)
    rows = [[f"ours, {name}", f"{r['positions']:,}", f"{r['top1_agreement']:.4f}", f"{r['kl_mean']:.5f}",
             f"{r['kl_median']:.5f}", f"{r['kl_p99']:.5f}"] for name, r in data["formats"].items()]
    peer = data.get("llama_cpp_q4_1")
    if peer:
        rows.append(["llama.cpp, its Q4_1 file", f"{data['windows']} windows", f"{peer.get('top1_agreement', float('nan')):.4f}",
                     f"{peer.get('kl_mean', float('nan')):.5f}", f"{peer.get('kl_median', float('nan')):.5f}",
                     f"{peer.get('kl_p99', float('nan')):.5f}"])
    header = ["engine, weights", "positions", "top-1 agreement with float32", "mean KL", "median KL", "99th percentile KL"]
    return Table(table(header, rows), [path])


def peers() -> Table:
    """llama.cpp beside us (make bench-peers): one row per engine and mode, c=1 and c=16 of
    the same run, ratios over llama.cpp plain (the run's baseline)."""
    path = "results/peers/peers.json"
    data = read(path)
    points = data["load_points"]
    first = next(iter(points.values()))
    modes = [r["mode"] for r in first["runs"] if r["load"] == first["runs"][0]["load"]]
    rows = []
    for mode in modes:
        name = mode.split("/")[0]
        row = [name]
        for c, point in points.items():
            run = next(r for r in point["runs"] if r["mode"] == mode)
            speed = next((s for s in point["speedup"] if s["mode"] == mode), None)
            per_user = f"{run['per_user_tok_s']['mean']:.1f}"
            if c == "1":
                over = "1 (baseline)" if speed is None else f"{speed['per_user_tok_s_ratio']:.2f}x"
                row += [per_user, over, f"{run['ttft_ms']['p50']:.0f}", f"{run['itl_ms']['p50']:.1f}"]
            else:
                over = "1 (baseline)" if speed is None else f"{speed['output_tok_s_ratio']:.2f}x"
                row += [f"{run['output_tok_s']:.1f}", over, per_user]
        same = [p["identity_within_engines"].get(name) for p in points.values()]
        row.append(", ".join(f"{s['identical']}/{s['compared']}" for s in same if s) or "-")
        rows.append(row)
    header = ["engine, mode", "c=1 tok/s per user", "over llama.cpp", "c=1 TTFT p50 (ms)", "c=1 ITL p50 (ms)",
              "c=16 aggregate tok/s", "over llama.cpp", "c=16 tok/s per user", "greedy = own plain (c=1, c=16)"]
    return Table(table(header, rows), [path])


def mutation_score() -> Table:
    """`make mutants`' record against today's list and code: a record made before a mutated file
    changed says how many changed (tests/project/test_mutants.py fails when a listed mutant has
    no result)."""
    from specdec.tools.mutants import DEFAULT_LIST, DEFAULT_OUT, load_mutants, record_status
    path = str(DEFAULT_OUT)
    record = read(path)
    totals = record["totals"]
    status = record_status(record, load_mutants(DEFAULT_LIST), ROOT)
    areas = sorted({r["file"].split("/")[0] if r["file"].count("/") < 2 else "/".join(r["file"].split("/")[:2])
                    for r in record["mutants"]})
    rows = [[f"{totals['mutants']}", f"{totals['killed']}", f"{totals['timeout']}", f"{totals['survived']}",
             f"{totals['error']}", f"{totals['score']:.1%}", ", ".join(f"`{s}`" for s in totals["survivors"]) or "none",
             f"{len(status.changed_files)} of {len(status.files)}" + (f" ({', '.join(status.changed_files)})" if 0 < len(status.changed_files) <= 6 else ""),
             ", ".join(f"`{a}`" for a in areas)]]
    header = ["mutants", "killed", "killed by timeout", "survived", "errors", "score", "survivors",
              "mutated files changed since the record", "code mutated"]
    markdown = table(header, rows)
    markdown += (f"\n\nResults stale (their file or what their tests load changed since, or recorded before the tests "
                 f"were hashed): {len(status.stale)} of {totals['mutants']}; `python -m specdec.tools.mutants --stale "
                 f"{path}` reruns them.")
    for update in record.get("updates", []):
        ids = update["mutants"]
        named = ", ".join(f"`{m}`" for m in ids) if len(ids) <= 6 else f"{len(ids)} mutants (their ids in the record)"
        how = "--stale" if "--stale" in update.get("command", "") else "--update"
        markdown += (f"\n\nRerun since (`{how}`, results/mutants.json's updates): {named} at commit "
                     f"{update['commit'][:7]}{'' if update.get('clean') else ' with local changes'}, {update['date'][:10]}.")
    return Table(markdown, [path])


def files_behind(cited: str) -> list[str]:
    """The files a cited results path stands for: itself, or for a folder its summary.json,
    else the JSON files directly in it, else every summary.json below it."""
    path = ROOT / cited
    if path.is_file():
        return [cited] if path.suffix == ".json" else []
    if (path / "summary.json").is_file():
        return [str(Path(cited.rstrip("/")) / "summary.json")]
    found = sorted(path.glob("*.json")) or sorted(path.rglob("summary.json"))
    return [str(p.relative_to(ROOT)) for p in found]


def recorded_or_unknown(path: str) -> tuple[str, str, str]:
    """provenance(), or "unknown" for a file that records no commit or date itself (measured
    before the writer recorded them; results/provenance.json's inferences are not shown as
    measured)."""
    try:
        return provenance(path)
    except (ValueError, AttributeError, json.JSONDecodeError):  # no commit or date; not a JSON object
        return "unknown", "unknown", "unknown"


def cited_in_results_doc() -> Table:
    """Where docs/results.md's figures come from: every results path its prose cites, each with
    the commit (and tree state), date and machine that the file records, or unknown."""
    text = BLOCK.sub("", RESULTS_DOC.read_text())
    rows: dict[str, list[str]] = {}  # a folder and a file in it can name one file
    for cited in sorted(set(CITED.findall(text))):
        files = files_behind(cited)
        if not files:
            rows[cited] = [f"`{cited}`", "no JSON record", "", ""]
        for path in files:
            rows[path] = [f"`{path}`", *recorded_or_unknown(path)]
    return Table(table(["file", "commit", "date", "machine"], [rows[k] for k in sorted(rows)]), [])


# --- docs/results.md's tables (rendered there as README's are here) ---

def capture_cost() -> Table:
    """Capture on over off, per load: bench-capture's verdict, its blocks, ITL and TTFT, and the
    greedy outputs the harness compared."""
    path = "results/capture/capture_cost.json"
    rows, sources = [], [path]
    for concurrency, point in sorted(read(path)["load_points"].items(), key=lambda kv: int(kv[0])):
        entry = point["speedup"][0]
        summary_path = f"results/capture/c{concurrency}/summary.json"
        check = read(summary_path)["lossless"]
        sources.append(summary_path)
        blocks = entry["block_gains"]
        rows.append([f"c={concurrency}", f"{entry['output_tok_s_ratio']:.2f}x", f"{min(blocks):.2f}-{max(blocks):.2f}",
                     f"{entry['itl_p50_ratio']:.2f}x", f"{entry['ttft_p50_ratio']:.2f}x",
                     f"{check['identical']}/{check['compared']}"])
    header = ["load", "capture on / off, output tok/s", "blocks", "ITL p50", "TTFT p50", "outputs identical"]
    return Table(table(header, rows), sources)


MODE_NOTES = {"eagle3-hybrid": "eagle3-hybrid (EAGLE-3 + n-gram + suffix)",
              "eagle3-hybrid-ngram": "eagle3-hybrid-ngram (the hybrid before suffix)"}


def conversation_ttft() -> Table:
    """TTFT p50 over turns 3 and 4 of bench-conversations' requests, with the prefix cache
    (each mode's own salt) and without (`/no-cache`), and their ratio."""
    import statistics

    path = "results/bench/conversations/requests.jsonl"
    ttfts: dict[str, list[float]] = {}
    for line in (ROOT / path).read_text().splitlines():
        request = json.loads(line)
        if request["turn"] in (2, 3):  # 0-based: the third and fourth turns
            ttfts.setdefault(request["mode"], []).append(request["chunks"][0] - request["send"])
    rows = []
    for mode in [m for m in ttfts if not m.endswith("/no-cache")]:
        cached, uncached = (statistics.median(ttfts[m]) * 1000 for m in (mode, f"{mode}/no-cache"))
        ratio = f"{cached / uncached:.2f}x"
        rows.append([MODE_NOTES.get(mode, mode), f"{cached:.0f} ms", f"{uncached:.0f} ms",
                     f"**{ratio}**" if mode == "baseline" else ratio])
    return Table(table(["mode", "with the cache", "without", "ratio"], rows), ["results/bench/conversations/summary.json"])


SUFFIX_NOTES = {**MODE_NOTES, "suffix": "suffix (ours)", "arctic-suffix": "arctic-suffix (Arctic Inference's)"}


def suffix_blocks() -> Table:
    """bench-suffix per mode with each block's gain and the TPOT ratio (README's `suffix`
    table, in full)."""
    path = "results/bench/suffix/summary.json"
    runs, speedups, _ = summary_index(path)
    load = "c=1"
    best = best_mode(speedups, load)
    rows = []
    for mode in by_ratio(speedups, modes_of(runs, load), load):
        entry = speedups[(mode, load)]
        gain = f"{entry['output_tok_s_ratio']:.2f}x"
        rows.append([noted(mode, SUFFIX_NOTES, mode == best),
                     f"**{gain}**" if mode == best else gain, ", ".join(f"{g:.2f}" for g in entry["block_gains"]),
                     f"{entry['tpot_p50_ratio']:.2f}x", accept_len(runs[(mode, load)])])
    base = runs[("baseline", load)]["output_tok_s"]
    header = [f"mode (x baseline, {base:.1f} tok/s)", "output tok/s", "blocks", "TPOT p50", "accept len"]
    return Table(table(header, rows), [path])


def heads_by_workload() -> Table:
    """The latest bench-head-acceptance run's head versions side by side per workload (README's
    `head-acceptance` rows, one cell per version)."""
    path = "results/heads/summary.json"
    rows = [r for r in read(path)["rows"] if r["head"] != "shipped"]
    heads = list(dict.fromkeys(r["head"] for r in rows))
    cell = {(r["head"], r["workload"]): r for r in rows}
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        picked = [cell[(h, workload)] for h in heads]
        out.append([workload] + [" / ".join(f"{value(r):.2f}" for r in picked) for value in (
            lambda r: r["chain"]["mean_acceptance_length"], lambda r: r["tree"]["mean_acceptance_length"],
            lambda r: r["chain"]["speedup_c1"], lambda r: r["tree"]["speedup_c1"])])
    versions = " / ".join(heads)
    header = ["workload", f"MAL chain K=5, {versions}", "MAL tree d4k4n12", "c=1 x plain, chain", "tree"]
    return Table(table(header, out), [path])


def shapes_by_head_dtype() -> Table:
    """bench-tree-shapes per shape, the int8 and bfloat16 head side by side (README's
    `tree-shapes` rows, paired)."""
    path = "results/tree_shapes/summary.json"
    by_shape: dict[str, dict[str, dict]] = {}
    for r in read(path)["rows"]:
        by_shape.setdefault(r["shape"], {})[r.get("draft_dtype", "bfloat16")] = r
    rows = [[shape, f"{pair['int8']['mean_acceptance_length']:.2f} / {pair['bfloat16']['mean_acceptance_length']:.2f}",
             f"{pair['int8']['speedup_c1']:.2f}", f"{pair['bfloat16']['speedup_c1']:.2f}"]
            for shape, pair in by_shape.items()]
    return Table(table(["shape", "MAL int8 / bf16", "c=1 x plain, int8 head", "bf16 head"], rows), [path])


FAMILY_NOTES = {0.7: {"eagle3": "eagle3 (sampled chain)", "eagle3-tree": "eagle3-tree (top-k, one-hot rule)",
                      "eagle3-hybrid": "eagle3-hybrid (sampled chain + one-hot n-gram continuation)",
                      "medusa": "medusa (sampled chain)"}}


def drafting_families(path: str, temperature: float) -> Table:
    """bench-heads per method at c=1 and c=4 (mean acceptance at c=1, each ratio's blocks) with
    bench-drafters' draft cost per sequence step at the same temperature; the best ratio per
    load in bold."""
    runs, speedups, _ = summary_index(path)
    drafters_path = "results/drafters/bench_drafters.json"
    draft_ms = next(r["methods"] for r in read(drafters_path)["runs"] if r["temperature"] == temperature)
    modes = modes_of(runs, "c=1")
    best = {load: best_mode(speedups, load) for load in ("c=1", "c=4")}
    rows = []
    for mode in modes:
        rows.append([noted(mode, FAMILY_NOTES.get(temperature, {}), best["c=1"] == mode), accept_len(runs[(mode, "c=1")]), f"{draft_ms[mode]['draft_ms_per_seq_step']:.1f}",
                     *[ratio(speedups[(mode, load)], bold=best[load] == mode) for load in ("c=1", "c=4")]])
    return Table(table(["method", "mean acc. length", "draft ms / step", "c=1 x baseline", "c=4 x baseline"], rows),
                 [path, drafters_path])


STOPS_WHERE = {"engine": "in process (engine, c=16)",
               "server": "Triton (speculative_loop and ensemble alternating, gRPC, c=16)"}


def stop_checks() -> Table:
    """check-stops in process and through Triton: every method's outputs against the
    baseline's, how many ended by a stop, and baseline cuts that were wrong."""
    rows, sources = [], []
    for where, label in STOPS_WHERE.items():
        path = f"results/stops/{where}.json"
        record = read(path)
        sources.append(path)
        methods = record["methods"].values()
        per = {m["identical"] for m in methods}
        stopped = {m["stopped"] for m in methods}
        each = f"{per.pop()}/{record['cases']} each" if len(per) == 1 else "differs by method"
        rows.append([label, str(record["prompts"]), str(record["cases"]), f"the {len(record['methods'])} served then",
                     f"{each} ({sum(m['identical'] for m in methods):,}/{record['cases'] * len(record['methods']):,})",
                     str(stopped.pop()) if len(stopped) == 1 else "differs by method", str(len(record["baseline_cut_wrong"]))])
    header = ["where", "prompts", "cases per method", "methods", "identical to the baseline", "ended by a stop", "baseline cut wrong"]
    return Table(table(header, rows), sources)


SIBLING_LABELS = {"baseline": "baseline (the {n} choices at once)", "suffix": "suffix, the {n} choices at once",
                  "suffix in turn": "suffix, in turn (`siblings_in_turn`)"}


def siblings() -> Table:
    """bench-siblings: n choices through the OpenAI front end, at once and in turn."""
    path = "results/openai/siblings.json"
    record = read(path)
    rows = []
    for mode, run in record["modes"].items():
        gain = record["x_baseline"][mode]
        rows.append([SIBLING_LABELS.get(mode, mode).format(n=record["siblings"]), f"{run['tok_s']:.1f}",
                     "1" if mode == "baseline" else f"{gain:.2f}x", f"{run['tokens_per_step']:.2f}", str(run["accepted"])])
    header = ["mode", "output tok/s (wall)", "x baseline", "tokens per verification step", "accepted draft tokens"]
    return Table(table(header, rows), [path])


DRAFT_PLACES = {"draft_model": ("`draft_model` (K=3)", "`drafter` model, its own process"),
                "draft_model:2": ("`draft_model:2`", "`drafter` model"),
                "draft-colocated": ("`draft_model-colocated` (K=3)", "beside the target in `verifier`"),
                "draft_model-adaptive": ("`draft_model-adaptive`", "beside the target, planned"),
                "eagle3-hybrid": ("`eagle3-hybrid` (same run)", "beside the target")}


def draft_served() -> Table:
    """The independent draft model through Triton (specdec-client bench), where it runs."""
    path = "results/bench/draft-c1/summary.json"
    runs, speedups, _ = summary_index(path)
    rows = []
    for mode in modes_of(runs, "c=1"):
        entry = speedups[(mode, "c=1")]
        label, where = DRAFT_PLACES.get(mode, (f"`{mode}`", ""))
        rows.append([label, where, ratio(entry), f"{entry['per_user_tok_s_ratio']:.2f}x", accept_len(runs[(mode, "c=1")])])
    header = ["mode", "where the draft runs", "output tok/s vs baseline (blocks)", "per-user", "mean acc. len"]
    return Table(table(header, rows), [path])


DRAFT_LABELS = {"L1": "first layers + head, ShareGPT only", "L2": "same", "L4": "same",
                "draft-smollm2-135m": "shipped: 2 layers + self-distilled answers"}


def draft_tradeoff() -> Table:
    """make bench-draft: each draft's size, its pass against a target step, and c=1 speed at
    K=1-3 in process."""
    path = "results/draft/bench_draft.json"
    rows = []
    for name, draft in read(path)["drafts"].items():
        runs = draft["runs"]
        rows.append([DRAFT_LABELS.get(name, name), str(draft["layers"]), f"{draft['bf16_mb_without_embedding']:.1f}",
                     f"{draft['draft_cost_fraction']:.3f}", *[f"{runs[k]['over_baseline']:.2f}x" for k in ("1", "2", "3")],
                     ", ".join(f"{a:.2f}" for a in runs["3"]["per_position_acceptance"])])
    header = ["draft", "layers", "MB", "draft pass / target step", "K=1", "K=2", "K=3", "per-position acceptance (K=3)"]
    return Table(table(header, rows), [path])


PATH_NAMES = {"avx2": "AVX2", "avx512_vnni": "AVX-512 VNNI", "amx": "AMX"}


def paths_and_threads() -> Table:
    """The whole int8 forward per kernel path and thread count (medians of the runs)."""
    path = "results/kernels/paths_and_threads.json"
    rows = []
    for n, (key, ms) in enumerate(read(path)["forward_ms_median"].items()):
        kernel, threads = key.split("/")
        unit = " ms" if n == 0 else ""
        rows.append([f"{PATH_NAMES.get(kernel, kernel)}, {threads} thread{'s' if threads != '1' else ''}",
                     *[f"{ms[k]:.1f}{unit}" for k in ("k1", "k16", "b16_k1")]])
    return Table(table(["path / threads", "1 row", "16 rows (one sequence)", "16 sequences x 1 row"], rows), [path])


SERVED_PATH_PAIRED = "results/profiles/served_path/paired"


def served_path_paired() -> Table:
    """Issue 60's before/after rounds: served tok/s, and CPU per token outside the verifier's
    stub (the relay stub and tritonserver; after: tritonserver only, the relay gone)."""
    def outside(point: dict) -> float:  # tritonserver and every stub but the one hosting the verifier (the busiest)
        server = {k: v["total_ms_per_token"] for k, v in point["cpu"].items() if k == "tritonserver" or k.startswith("stub:")}
        host = max((k for k in server if k.startswith("stub:")), key=server.get)
        return sum(v for k, v in server.items() if k != host)

    sides = {side: [{p["concurrency"]: p for p in read(f"{SERVED_PATH_PAIRED}/{side}_r{r}.json")["points"]} for r in (1, 2)]
             for side in ("before", "after")}
    rows = []
    for c in (1, 16):
        rows.append([f"c={c} output tok/s"] + [" / ".join(f"{run[c]['served']['output_tok_s']:.1f}" for run in runs)
                                               for runs in sides.values()])
    for c in (1, 16):
        rows.append([f"c={c} CPU per token outside the verifier's stub"]
                    + [" / ".join(f"{outside(run[c]):.2f}" for run in runs) + " ms" for runs in sides.values()])
    sources = [f"{SERVED_PATH_PAIRED}/{side}_r{r}.json" for side in sides for r in (1, 2)]
    return Table(table(["", "before, round 1 / 2", "after, round 1 / 2"], rows), sources)


def v5_heldout() -> Table:
    """The shipped head's held-out checks beside the head it continued (its training log)."""
    path = "models/eagle3-smollm2-135m/train_log.json"
    log = read(path)

    def cells(record: dict) -> list[str]:
        overlap = record["heldout_sampled_overlap"]
        return [", ".join(f"{a:.3f}" for a in values)
                for values in (record["heldout_top1_by_position"], overlap["T=0.7"], overlap["T=1.0"])]

    accepted = log["heldout_acceptance"]
    rows = [["v3 (shipped before)", *cells(log["init_head_heldout"]), "not in this log"],
            ["v5 (shipped now)", *cells(log), f"{accepted['mean_acceptance_length']:.2f} ("
             + ", ".join(f"{a:.2f}" for a in accepted["per_position_acceptance"][:4]) + ")"]]
    header = ["", "top-1 by draft position", "sum min(p, q), T=0.7", "sum min(p, q), T=1.0", "greedy MAL K=5 (per position)"]
    return Table(table(header, rows), [path])


ISSUE74 = "results/bench/load/issue74"


def _points(path: str) -> dict[tuple[int, str], list[dict]]:
    """bench-load's points by (concurrency, mode), in block order."""
    points: dict[tuple[int, str], list[dict]] = {}
    for point in read(path)["points"]:
        points.setdefault((point["concurrency"], point["mode"]), []).append(point)
    return points


def served_over_in_process() -> Table:
    """Issue 74's first round: Triton's output tok/s over the in-process engine's, per block,
    before and after, at c=1 and c=16, baseline and eagle3-hybrid."""
    columns = [(1, "baseline"), (1, "eagle3-hybrid"), (16, "baseline"), (16, "eagle3-hybrid")]
    rows, sources = [], []
    for path in (f"{ISSUE74}/before_81df8db.json", f"{ISSUE74}/after_7ffaba5.json"):
        points = _points(path)
        sources.append(path)
        rows.append([f"{provenance(path)[0][:7]}, blocks " + " / ".join(str(p["block"]) for p in points[columns[0]])]
                    + [" / ".join(f"{p['triton_over_in_process']:.2f}" for p in points[c]) for c in columns])
    header = [""] + [f"c={c} {mode}" for c, mode in columns]
    return Table(table(header, rows), sources)


VERIFIER_THREADS_RUNS = [  # (row, files in the order they ran)
    ("2 (no core to spare: nothing placed)", ["verifier2_a", "verifier2_b", "verifier2_c", "verifier2_d"]),
    ("1, unplaced", ["verifier1_a", "verifier1_b"]),
    ("1, placed (forward on one core, every other stub thread on the other)", ["placed_verifier1_a", "placed_verifier1_b"]),
]


def verifier_threads() -> Table:
    """threads.verifier 2 against 1, unplaced and placed: Triton's baseline tok/s per run and
    the range of its ratio to the in-process engine."""
    rows, sources = [], []
    for label, names in VERIFIER_THREADS_RUNS:
        paths = [f"{ISSUE74}/threads/{name}.json" for name in names]
        sources += paths
        runs = [_points(path) for path in paths]
        cells = []
        for concurrency in (1, 16):
            cells.append(", ".join(f"{run[(concurrency, 'baseline')][0]['triton']['output_tok_s']:.0f}" for run in runs))
        ratios = []
        for concurrency in (1, 16):
            values = [p["triton_over_in_process"] for run in runs for p in run[(concurrency, "baseline")]]
            ratios.append(f"{min(values):.2f}-{max(values):.2f}")
        rows.append([label, *cells, ", ".join(ratios)])
    header = ["`threads.verifier`", "c=1", "c=16", "Triton / in process, c=1 and c=16"]
    return Table(table(header, rows), sources)


def aiperf_cross_check(folder: str = "results/aiperf-1thread") -> Table:
    """bench-aiperf: our client and aiperf against the same server, per mode and concurrency,
    each figure as `client / aiperf` (the ratio aiperf / client where the page explains it);
    the server's own step time under each tool from its counters."""
    comparison = f"{folder}/comparison.json"
    data = read(comparison)
    sources = [comparison]
    step_ms = {(run["tool"], run["concurrency"], label): counters["step_ms"]
               for run in data["runs"] for label, counters in run["server"].items()}
    rows = []
    for row in data["rows"]:
        mode, concurrency = row["mode"], row["concurrency"]
        client_summary = f"{folder}/client/c{concurrency}/summary.json"
        aiperf_export = f"{folder}/aiperf/{mode}-c{concurrency}/profile_export_aiperf.json"
        for path in (client_summary, aiperf_export):
            if path not in sources:
                sources.append(path)
        client_ttft = summary_index(client_summary)[0][(mode, f"c={concurrency}")]["ttft_ms"]["mean"]
        aiperf_ttft = read(aiperf_export)["time_to_first_token"]["avg"]
        client, aiperf = row["client"], row["aiperf"]
        label = "none" if mode == "baseline" else mode
        speedup = f"{row['speedup']['client']:.2f}x / {row['speedup']['aiperf']:.2f}x"
        rows.append([
            mode, str(concurrency),
            f"{client['output_tok_s']:.1f} / {aiperf['output_tok_s']:.1f} ({aiperf['output_tok_s'] / client['output_tok_s']:.2f})",
            f"{client_ttft:.0f} / {aiperf_ttft:.0f} ({aiperf_ttft / client_ttft:.2f})",
            f"{client['ttft_p50_ms']:.0f} / {aiperf['ttft_p50_ms']:.0f}",
            f"{client['itl_p50_ms']:.1f} / {aiperf['itl_p50_ms']:.1f}",
            f"{step_ms[('specdec-client', concurrency, label)]:.1f} / {step_ms[('aiperf', concurrency, label)]:.1f}",
            f"**{speedup}**" if mode != "baseline" else speedup,
        ])
    header = ["mode", "c", "output tok/s client / aiperf", "TTFT mean ms client / aiperf", "TTFT p50 ms client / aiperf",
              "client inter-chunk / aiperf ITL p50 ms", "server step ms under client / aiperf", "speedup client / aiperf"]
    return Table(table(header, rows), sources)


PREFILL_BUDGET = "results/bench/prefill-budget"
PREFILL_WORKLOADS = [("waves", "baseline", "c=16, 64 tokens, EOS ignored (waves of 16 prompts)"),
                     ("waves", "eagle3-hybrid", "the same, eagle3-hybrid"),
                     ("to-eos", "baseline", "c=16, to EOS (at most 128 tokens)"),
                     ("c1-1000", "baseline", "c=1, 1,000-token prompts, 16 tokens")]


def prefill_budget() -> Table:
    """Issue 74 item 4: the commit before the prefill budget against the one after, ABBA (the
    two rounds' figures as `round 1 / round 2`), per workload: TTFT (all, a block's first wave),
    each stream's longest gap over its median, the streams whose longest gap passed 3x, tok/s."""
    path = f"{PREFILL_BUDGET}/summary.json"
    runs = read(path)["runs"]
    sources = [path]
    rows = []
    for workload, mode, label in PREFILL_WORKLOADS:
        for side in ("before", "after"):
            points = [runs[f"{workload}-{side}-{n}"][mode] for n in (1, 2)]
            sources += [f for f in (f"{PREFILL_BUDGET}/{workload}-{side}-{n}/summary.json" for n in (1, 2)) if f not in sources]

            def both(key: str, form: str) -> str:
                return " / ".join("-" if p[key] is None else format(p[key], form) for p in points)

            rows.append([label if side == "before" else "", side, both("ttft_p50_ms", ".0f"), both("first_wave_ttft_p50_ms", ".0f"),
                         both("gap_over_median_max", ".1f"),
                         " / ".join(f"{p['streams_over_3x']} of {p['streams']}" for p in points), both("output_tok_s", ".1f")])
    header = ["workload", "tree", "TTFT p50 ms", "first wave TTFT p50 ms", "longest gap / the stream's median, worst stream",
              "streams with a gap > 3x their median", "output tok/s"]
    return Table(table(header, rows), sources)


LOCUST_AB = "results/loadtest/issue74"
LOCUST_AB_RUNS = ["old-2", "old-3", "new-1", "new-2"]  # old-1 ran beside a test run: left out (docs/results.md)


def locust_production_ab() -> Table:
    """Issue 74 item 5: Locust production (16 users, 128 tokens, 120 s a mode) through Triton on
    140f0e6 and on this round's tree, run by run: the baseline's tok/s and TTFT, each method's
    tok/s over the baseline's of the same run, and failures."""
    from specdec_client.locust_stats import mode_figures

    modes = ["baseline", "eagle3-hybrid", "ngram-adaptive"]
    rows, sources = [], []
    for run in LOCUST_AB_RUNS:
        folder = ROOT / LOCUST_AB / run
        record = f"{LOCUST_AB}/{run}/production_run.json"
        sources.append(record)
        figures = {mode: mode_figures(folder, "production", mode) for mode in modes}
        base = figures["baseline"]
        rows.append([run, provenance(record)[0], f"{base.output_tok_s:.1f}", f"{base.ttft_p50_ms:.0f}", f"{base.tpot_p50_ms:.0f}",
                     *(f"{figures[m].output_tok_s / base.output_tok_s:.2f}x" for m in modes[1:]),
                     str(sum(f.failures for f in figures.values())), str(sum(f.requests for f in figures.values()))])
    header = ["run", "commit", "baseline tok/s", "baseline TTFT p50 ms", "baseline TPOT p50 ms", "eagle3-hybrid / baseline",
              "ngram-adaptive / baseline", "failures", "requests"]
    return Table(table(header, rows), sources)


TABLES: dict[str, Callable[[], Table]] = {
    "capture-cost": capture_cost,
    "conversation-ttft": conversation_ttft,
    "suffix-blocks": suffix_blocks,
    "heads-by-workload": heads_by_workload,
    "shapes-by-head-dtype": shapes_by_head_dtype,
    "second-model-blocks": lambda: second_model(blocks=True),
    "families-greedy": lambda: drafting_families("results/bench/heads-greedy/summary.json", 0.0),
    "v5-blocks": lambda: v5(detail=True),
    "stop-checks": stop_checks,
    "siblings": siblings,
    "in-flight-now": in_flight,
    "v5-heldout": v5_heldout,
    "paths-and-threads": paths_and_threads,
    "served-path-paired": served_path_paired,
    "closed-loop-greedy": lambda: by_concurrency("results/bench/load/closed_greedy/summary.json", acceptance=True),
    "draft-served": draft_served,
    "draft-tradeoff": draft_tradeoff,
    "families-t07": lambda: drafting_families("results/bench/heads-t07/summary.json", 0.7),
    "load-sweep-greedy": lambda: by_concurrency("results/bench/matrix-greedy/summary.json"),
    "load-sweep-t07": lambda: by_concurrency("results/bench/matrix-t07/summary.json"),
    "served-over-in-process": served_over_in_process,
    "verifier-threads": verifier_threads,
    "aiperf-cross-check": aiperf_cross_check,
    "prefill-budget": prefill_budget,
    "locust-production-ab": locust_production_ab,
    "results-doc-sources": cited_in_results_doc,
    "mutants": mutation_score,
    "structured": structured,
    "tools": lambda: structured("results/bench/tools/summary.json", "are one call whose arguments validate"),
    "conversations": conversations,
    "suffix": suffix,
    "in-flight": in_flight,
    "ttft-by-length": ttft_by_length,
    "load-sweep": lambda: by_concurrency("results/bench/load/closed_greedy/summary.json"),
    "matrix-greedy": lambda: by_concurrency("results/bench/matrix-greedy/summary.json"),
    "heads": heads,
    "v5": v5,
    "head-acceptance": head_acceptance,
    "tree-shapes": tree_shapes,
    "served-shapes": served_shapes,
    "greedy-margin": greedy_margin,
    "weight-formats": weight_formats,
    "verify-cost": verify_cost,
    "format-quality": format_quality,
    "peers": peers,
    "second-model": second_model,
}


def render(name: str, to_root: str = "") -> str:
    t = TABLES[name]()
    return f"{t.markdown}\n\n{source_line(t.sources, to_root)}\n" if t.sources else f"{t.markdown}\n"


def rewrite(text: str, document: Path = README) -> tuple[str, list[str]]:
    """A document (README.md, docs/results.md) with every table re-rendered, its links relative
    to where the document lives; the names of unknown tables."""
    unknown = []
    depth = len(Path(document).resolve().parent.relative_to(ROOT).parts)
    to_root = "../" * depth

    def replace(m: re.Match) -> str:
        name = m["name"]
        if name not in TABLES:
            unknown.append(name)
            return m[0]
        return m[1] + render(name, to_root) + m[4]

    return BLOCK.sub(replace, text), unknown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specdec readme-tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail when the README's tables differ from their sources")
    ap.add_argument("--readme", help=f"one document (default: {', '.join(str(d.relative_to(ROOT)) for d in DOCUMENTS)})")
    args = ap.parse_args(argv)
    status = 0
    for path in [Path(args.readme)] if args.readme else DOCUMENTS:
        text = path.read_text()
        new, unknown = rewrite(text, path)
        if unknown:
            print(f"{path}: unknown tables: {', '.join(unknown)} (known: {', '.join(TABLES)})", file=sys.stderr)
            status = 1
        elif args.check:
            if new != text:
                print(f"{path}: tables differ from their sources: run `specdec readme-tables`", file=sys.stderr)
                status = 1
        else:
            path.write_text(new)
            print(f"rewrote {len(BLOCK.findall(new))} tables in {path}")
    return status
