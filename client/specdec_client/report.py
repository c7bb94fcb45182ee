"""report.md and PNG plots from a benchmark's summary.json and requests.jsonl."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from specdec_client import metrics as M

PLOTS = ("throughput_vs_concurrency.png", "ratio_vs_concurrency.png", "itl_cdf.png", "inter_chunk_latency_cdf.png",
         "acceptance_by_position.png", "latency_vs_rate.png")
ADAPTIVE_FLOOR = 0.97  # the ratio to the baseline an adaptive budget should never fall below
NEAR_BEST = 0.97  # "within 3% of the best fixed configuration"


def _f(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


# ---- report.md ---------------------------------------------------------------------------
def environment_lines(summary: dict[str, Any]) -> list[str]:
    env, cfg = summary["env"], summary["config"]
    host, server, sc = env["host"], env.get("server", {}), env["server_config"]
    ds = env["dataset"]
    gpus = ", ".join(host["gpu_models"]) or "none"
    spec = sc.get("speculative", {})
    if "deployments" in server:  # two deployments side by side
        where = [f"- {name}: `{d['endpoint']}` ({d['kind']}, model `{d.get('model') or 'the server default'}`"
                 + (f", {d['server'].get('name', '?')} {d['server'].get('version', '?')}" if d.get("server") else "") + ")"
                 for name, d in server["deployments"].items()]
    else:
        where = [f"- server: {server.get('name', '?')} {server.get('version', '?')} at `{cfg['url']}` ({cfg['protocol']}, model `{cfg['model']}`)"]
    return [
        f"- date: {env['date']}",
        *where,
        f"- host: {host['cpu_model']} x {host['cpu_count']} CPUs ({host.get('cpus_usable')} usable); GPUs: {gpus}",
        f"- server config `{sc.get('path')}`: precision {sc.get('precision')}, max_batch_size {sc.get('max_batch_size')}, "
        f"threads {sc.get('threads')}, default method {spec.get('default_method')}",
        f"- methods: {spec.get('methods')}",
        f"- data set: {ds.get('name')} ({ds.get('selected')} prompts, seed {ds.get('seed')}); filter {ds.get('filter')}; "
        f"token counter: {ds.get('token_counter', 'n/a')}",
        f"- sampling: {env['sampling']}; repeats {cfg['repeats']}, block size {cfg['block_size'] or 'auto'}, "
        f"prompts per concurrency {cfg.get('prompts_per_concurrency') or 'all'}, warm-up {cfg['warmup']} per mode",
        f"- packages: {', '.join(f'{k} {v}' for k, v in env['packages'].items() if v)}",
    ]


RUN_HEADER = ("| mode | req | fail | TTFT p50/p99 ms | ITL (TPOT) p50/p99 ms | inter-chunk p50/p99 ms | E2E p50 ms "
              "| per-user tok/s mean | output tok/s | req/s | accept len | accept rate |")


def run_row(r: dict[str, Any]) -> str:
    return (f"| {r['mode']} | {r['requests']} | {r['failures']} | {_f(r['ttft_ms']['p50'])} / {_f(r['ttft_ms']['p99'])} "
            f"| {_f(r['itl_ms']['p50'])} / {_f(r['itl_ms']['p99'])} "
            f"| {_f(r['inter_chunk_latency_ms']['p50'])} / {_f(r['inter_chunk_latency_ms']['p99'])} | {_f(r['e2e_ms']['p50'], 0)} "
            f"| {_f(r['per_user_tok_s']['mean'])} | {_f(r['output_tok_s'])} | {_f(r['requests_per_s'], 2)} "
            f"| {_f(r['mean_acceptance_length'], 2)} | {_f(None if r['acceptance_rate'] is None else 100 * r['acceptance_rate'], 0, '%')} |")


METRIC_WORDS = {"output_tok_s": "aggregate output tok/s", "e2e_p50": "E2E p50 speed (baseline E2E / speculative E2E)"}


def speedup_row(s: dict[str, Any]) -> str:
    blocks = s["block_gains"]
    spread = f"{min(blocks):.2f}–{max(blocks):.2f}" if blocks else "–"
    return (f"| {s['mode']} | {_x(s['output_tok_s_ratio'])} | {_x(s['per_user_tok_s_ratio'])} "
            f"| {_x(s['ttft_p50_ratio'])} | {_x(s['itl_p50_ratio'])} | {_x(s['inter_chunk_latency_p50_ratio'])} "
            f"| {_x(s['e2e_p50_ratio'])} | {_x(s['verdict_gain'])} ({spread}) | {s['verdict']} |")


def comparing_deployments(summary: dict[str, Any]) -> bool:
    """Two deployments side by side (--baseline / --candidate), not one server's modes."""
    return any(m.get("endpoint") for m in summary["config"]["modes"])


def verdict_line(load: str, speedups: Sequence[dict[str, Any]], deployments: bool = False) -> str:
    """One sentence: does speculation (or the candidate deployment) pay at this load, by how
    much, on which metric."""
    scored = [s for s in speedups if s["verdict_gain"] is not None]
    if not scored:
        return f"- **{load}**: no comparison (missing baseline or failed runs)."
    best = max(scored, key=lambda s: s["verdict_gain"])
    metric = METRIC_WORDS[best["verdict_metric"]]
    change = f"{best['verdict_gain']:.2f}x {metric}"
    if deployments:
        judged = {M.PAYS: "beats the baseline", M.COSTS: "loses to the baseline"}.get(best["verdict"], "is within noise of the baseline")
        head = f"`{best['mode']}` {judged}: {change}"
    elif best["verdict"] == M.PAYS:
        head = f"speculation pays: best mode `{best['mode']}` gives {change}"
    elif best["verdict"] == M.COSTS:
        head = f"speculation costs: even the best mode `{best['mode']}` gives {change}"
    else:
        head = f"no clear difference: best mode `{best['mode']}` gives {change}, within noise"
    gains = {
        "aggregate output tok/s": best["output_tok_s_ratio"],
        "per-user tok/s": best["per_user_tok_s_ratio"],
        "ITL (TPOT) p50": None if not best["itl_p50_ratio"] else 1 / best["itl_p50_ratio"],
        "TTFT p50": None if not best["ttft_p50_ratio"] else 1 / best["ttft_p50_ratio"],
        "E2E p50": None if not best["e2e_p50_ratio"] else 1 / best["e2e_p50_ratio"],
    }
    largest, value = max(((k, v) for k, v in gains.items() if v is not None), key=lambda kv: kv[1])
    blocks = len(best["block_gains"])
    basis = (f"{blocks} paired blocks" if blocks > 1
             else "a single paired block, so no noise estimate: add --repeats or prompts")
    return (f"- **{load}**: {head}; the metric it helps most (or hurts least) is {largest} "
            f"({value:.2f}x, > 1 favours speculation); based on {basis}.")


def served_methods(summary: dict[str, Any]) -> dict[str, Any]:
    """The server's configured methods as recorded in the summary ({} when unknown)."""
    return summary["env"]["server_config"].get("speculative", {}).get("methods") or {}


def is_adaptive(summary: dict[str, Any], method: str | None) -> bool:
    """Whether the server's settings give `method` a measured, per-step draft budget."""
    return bool(method and served_methods(summary).get(method, {}).get("adaptive"))


def deployment_lines(summary: dict[str, Any]) -> list[str]:
    """Which configuration to deploy at which load: per closed-loop concurrency the best fixed
    and the best adaptive mode (aggregate output tok/s over the baseline), and the one to
    deploy: the best mode where speculation clearly pays, the baseline otherwise. Only for
    sweeps (two or more concurrencies)."""
    method_of = {r["mode"]: r["method"] for r in summary["runs"]}
    closed = sorted({s["concurrency"] for s in summary["speedup"] if s["request_rate"] is None and s["concurrency"]})
    if len(closed) < 2:
        return []
    lines = ["## Which configuration at which load", "",
             "| c | best fixed | best adaptive | adaptive / best fixed | deploy |", "|---|---|---|---|---|"]
    floors, gaps = [], []
    for c in closed:
        scored = [s for s in summary["speedup"] if s["concurrency"] == c and s["request_rate"] is None
                  and s["output_tok_s_ratio"] is not None]
        fixed = [s for s in scored if not is_adaptive(summary, method_of.get(s["mode"]))]
        adaptive = [s for s in scored if is_adaptive(summary, method_of.get(s["mode"]))]
        best_fixed = max(fixed, key=lambda s: s["output_tok_s_ratio"], default=None)
        best_adaptive = max(adaptive, key=lambda s: s["output_tok_s_ratio"], default=None)
        paying = [s for s in scored if s["verdict"] == M.PAYS]
        deploy = max(paying, key=lambda s: s["output_tok_s_ratio"], default=None)
        gap = (best_adaptive["output_tok_s_ratio"] / best_fixed["output_tok_s_ratio"]
               if best_fixed and best_adaptive else None)
        if best_adaptive:
            floors.append(min(s["output_tok_s_ratio"] for s in adaptive))
        if gap is not None:
            gaps.append(gap)

        def cell(s):
            return "–" if s is None else f"`{s['mode']}` {s['output_tok_s_ratio']:.2f}x"
        lines.append(f"| {c} | {cell(best_fixed)} | {cell(best_adaptive)} | {_x(gap)} "
                     f"| {cell(deploy) if deploy else 'baseline (speculation does not clearly pay)'} |")
    lines.append("")
    if floors:
        lines.append(f"- Every adaptive mode at every concurrency: lowest ratio to the baseline {min(floors):.2f}x "
                     f"(aim: >= {ADAPTIVE_FLOOR:.2f}x).")
    if gaps:
        lines.append(f"- Best adaptive vs best fixed: {min(gaps):.2f}x to {max(gaps):.2f}x "
                     f"(aim: >= {NEAR_BEST:.2f}x everywhere).")
    if not served_methods(summary):
        lines.append("- The server's method settings were not recorded, so no mode could be told to be adaptive.")
    lines += ["- Ratios are aggregate output tok/s over the baseline at the same load (closed loop); "
              "'deploy' needs a gain beyond 5% that every paired block agrees on.", ""]
    return lines


def render_markdown(summary: dict[str, Any], plots: Sequence[str]) -> str:
    lines = ["# Speculative decoding benchmark", "", "## Environment", "", *environment_lines(summary), ""]
    by_load: dict[str, list] = defaultdict(list)
    for r in summary["runs"]:
        by_load[r["load"]].append(r)
    speed_by_load: dict[str, list] = defaultdict(list)
    for s in summary["speedup"]:
        speed_by_load[s["load"]].append(s)
    lines += ["## Verdict", ""]
    lines += [verdict_line(load, speed_by_load.get(load, []), comparing_deployments(summary)) for load in by_load]
    lines += ["", "Ratios are speculative / baseline at the same load, same prompts and settings. "
              "Throughput ratios > 1 and latency ratios < 1 favour speculation. ITL (= TPOT) is per token: "
              "(E2E - TTFT) / (output tokens - 1) per request. Inter-chunk latency is the gap between streamed "
              "chunks; a speculative chunk carries several tokens, so its ratio is not a latency verdict. "
              "The verdict uses aggregate output tok/s under closed-loop load and E2E p50 under open-loop "
              "(Poisson) load; it needs a gain beyond 5% that every paired block agrees on.", ""]
    lines += deployment_lines(summary)
    for load, runs in by_load.items():
        lines += [f"## {load}", "", RUN_HEADER, "|" + "---|" * 12, *map(run_row, runs), ""]
        if speed_by_load.get(load):
            lines += ["| mode | output tok/s | per-user tok/s | TTFT p50 | ITL (TPOT) p50 | inter-chunk p50 | E2E p50 "
                      "| verdict gain (per block) | verdict |",
                      "|" + "---|" * 9, *map(speedup_row, speed_by_load[load]), ""]
    loss = summary["lossless"]
    lines += ["## Lossless check", ""]
    if loss.get("greedy") and not loss["compared"] and comparing_deployments(summary):
        lines.append("The two deployments serve different models (--no-same-model): outputs not compared.")
    elif loss.get("greedy"):
        lines.append(f"Greedy decoding: {loss['identical']} of {loss['compared']} speculative outputs are identical "
                     "to the baseline output for the same prompt.")
        lines += [f"- {m['mode']}: {m['identical']} / {m['compared']}" for m in loss.get("by_mode", [])]
    else:
        lines.append("Sampling (temperature > 0): outputs are not expected to match token for token; not compared.")
    lines += structured_lines(summary)
    lines += turn_lines(summary)
    lines += slo_lines(summary)
    lines += ["", "## Plots", "", *[f"![{p}]({p})" for p in plots], ""]
    return "\n".join(lines)


def structured_lines(summary: dict[str, Any]) -> list[str]:
    """Structured output: outputs that satisfy their guide, and of the accepted draft tokens
    those the grammar forced (drafted without the drafter)."""
    runs = [r for r in summary["runs"] if r.get("structured")]
    if not runs:
        return []
    lines = ["", "## Structured output", "", "| mode | load | valid outputs | accepted draft tokens | of them forced by the grammar |",
             "|---|---|---|---|---|"]
    for r in runs:
        s, accepted = r["structured"], r.get("accepted_tokens")
        forced = r.get("forced_accepted_tokens", 0)
        lines.append(f"| {r['mode']} | {r['load']} | {s['valid']} / {s['checked']} | {'-' if accepted is None else accepted} "
                     f"| {forced} |")
    return lines


def turn_lines(summary: dict[str, Any]) -> list[str]:
    """Conversations: per turn index, TTFT p50, TPOT p50, per-user speed and the prompt
    tokens the prefix cache supplied; with and without the cache side by side when both ran."""
    runs = [r for r in summary["runs"] if r.get("by_turn")]
    if not runs:
        return []
    lines = ["", "## Conversations, by turn", "",
             "Each turn sends the whole history, the model's own earlier answers included.", "",
             "| mode | load | turn | requests | TTFT p50 ms | TPOT p50 ms | per-user tok/s p50 | accept len | cached prompt tokens (mean) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for t in r["by_turn"]:
            lines.append(f"| {r['mode']} | {r['load']} | {t['turn'] + 1} | {t['requests']} | {t['ttft_ms']['p50']:.0f} "
                         f"| {t['tpot_ms']['p50']:.1f} | {t['per_user_tok_s']['p50']:.1f} | {t['mean_acceptance_length']:.2f} "
                         f"| {t['cached_prompt_tokens_mean']:.0f} |")
    return lines


def slo_lines(summary: dict[str, Any]) -> list[str]:
    """Goodput under the SLO per run and, over an open-loop rate sweep, the rate each mode sustains."""
    slo = summary.get("slo")
    if not slo:
        return []
    limits = " and ".join(f"{name} <= {slo[key]:g} ms" for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"))
                          if slo.get(key) is not None)
    lines = ["", "## Goodput under the SLO", "", f"SLO: {limits} per request; a rate is sustained when at least "
             f"{slo['attainment']:.0%} of its requests meet it (and every lower rate's do).", "",
             "| mode | load | goodput req/s | goodput tok/s | attainment |", "|---|---|---|---|---|"]
    for r in summary["runs"]:
        g = r.get("goodput")
        if g is not None:
            lines.append(f"| {r['mode']} | {r['load']} | {g['requests_per_s']:.2f} | {g['output_tok_s']:.1f} | {g['attainment']:.0%} |")
    if slo.get("sustained"):
        lines += ["", "| mode | highest sustained rate (req/s) |", "|---|---|"]
        lines += [f"| {s['mode']} | {'below the lowest rate' if s['sustained_rate'] is None else format(s['sustained_rate'], 'g')} |"
                  for s in slo["sustained"]]
    return lines


# ---- plots -------------------------------------------------------------------------------
def plot_all(summary: dict[str, Any], requests: Sequence[dict[str, Any]], out: Path) -> list[str]:
    """Write the PNGs; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, draw in zip(PLOTS, (_throughput, _ratio, _itl_cdf, _inter_chunk_cdf, _acceptance, _latency_vs_rate)):
        fig = draw(plt, summary, requests)
        if fig is not None:
            fig.tight_layout()
            fig.savefig(out / name, dpi=110)
            plt.close(fig)
            written.append(name)
    return written


def _modes(summary) -> list[str]:
    return list(dict.fromkeys(r["mode"] for r in summary["runs"]))


def _throughput(plt, summary, requests):
    runs = [r for r in summary["runs"] if r["concurrency"] is not None and r["request_rate"] is None]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in _modes(summary):
        pts = sorted((r["concurrency"], r["output_tok_s"]) for r in runs if r["mode"] == mode and r["output_tok_s"] is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mode)
    from matplotlib.ticker import ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("concurrency")
    ax.set_ylabel("aggregate output tok/s")
    ax.set_title("Output throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def _ratio(plt, summary, requests):
    """Each mode's aggregate output tok/s over the baseline's, by concurrency (sweeps only)."""
    speedups = [s for s in summary["speedup"] if s["request_rate"] is None and s["concurrency"]
                and s["output_tok_s_ratio"] is not None]
    if len({s["concurrency"] for s in speedups}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in _modes(summary):
        pts = sorted((s["concurrency"], s["output_tok_s_ratio"]) for s in speedups if s["mode"] == mode)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=mode)
    from matplotlib.ticker import ScalarFormatter

    ax.axhline(1.0, color="black", linewidth=1)
    ax.axhline(ADAPTIVE_FLOOR, color="grey", linewidth=1, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s / baseline")
    ax.set_title(f"Speedup over the baseline vs concurrency (dashed: {ADAPTIVE_FLOOR})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def _latency_vs_rate(plt, summary, requests):
    """TTFT and TPOT (p50, p90 dashed) against the open-loop request rate, per mode."""
    runs = [r for r in summary["runs"] if r["request_rate"] is not None]
    if len({r["request_rate"] for r in runs}) < 2:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    slo = summary.get("slo") or {}
    for ax, key, limit, title in ((axes[0], "ttft_ms", slo.get("ttft_ms"), "TTFT"), (axes[1], "tpot_ms", slo.get("tpot_ms"), "TPOT")):
        for mode in _modes(summary):
            for q, style in (("p50", "-"), ("p90", "--")):
                pts = sorted((r["request_rate"], r[key][q]) for r in runs if r["mode"] == mode and r[key][q] is not None)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{mode} {q}")
        if limit is not None:
            ax.axhline(limit, color="red", linewidth=1, label="SLO")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs request rate")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="x-small")
    return fig


def _samples_by_load_and_mode(summary, requests, values) -> dict[tuple[str, str], list[float]]:
    """values(trace) -> seconds, gathered in ms per (load label, mode) over successful requests."""
    label = {(r["concurrency"], r["request_rate"]): r["load"] for r in summary["runs"]}
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for req in requests:
        if req["error"] is None:
            t = M.Trace(req["send"], req["chunks"], req["end"], req["output_tokens"])
            out[(label.get((req["concurrency"], req["request_rate"])), req["mode"])] += [v * 1000 for v in values(t)]
    return out


def _cdf(plt, summary, samples: dict[tuple[str, str], list[float]], xlabel: str, ylabel: str, title: str):
    """One panel per load point, one CDF per mode."""
    if not any(samples.values()):
        return None
    loads = list(dict.fromkeys(r["load"] for r in summary["runs"]))
    fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 4), squeeze=False)
    for ax, load in zip(axes[0], loads):
        for mode in _modes(summary):
            data = sorted(samples.get((load, mode), []))
            if data:
                ax.step(data, [(i + 1) / len(data) for i in range(len(data))], where="post", label=mode)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}, {load}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    return fig


def _itl_cdf(plt, summary, requests):
    """Per-token ITL, one value per request: comparable across modes."""
    samples = _samples_by_load_and_mode(summary, requests, lambda t: [v for v in [M.itl(t)] if v is not None])
    return _cdf(plt, summary, samples, "ITL (ms per token, per request)", "fraction of requests", "ITL CDF")


def _inter_chunk_cdf(plt, summary, requests):
    """Pooled chunk gaps: a speculative chunk carries several tokens, so not per token."""
    samples = _samples_by_load_and_mode(summary, requests, M.inter_chunk_latencies)
    return _cdf(plt, summary, samples, "inter-chunk latency (ms, per chunk)", "fraction of gaps",
                "Inter-chunk latency CDF")


def _acceptance(plt, summary, requests):
    runs = [r for r in summary["runs"] if r["per_position_acceptance"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        pts = [(p["position"], p["acceptance"]) for p in r["per_position_acceptance"] if p["acceptance"] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{r['mode']} {r['load']}")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted)")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance by draft position")
    ax.grid(True, alpha=0.3)
    if runs:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no per-position data", ha="center", va="center", transform=ax.transAxes)
    return fig


def write_report(summary: dict[str, Any], requests: Sequence[dict[str, Any]], out: Path) -> list[str]:
    plots = plot_all(summary, requests, out)
    (out / "report.md").write_text(render_markdown(summary, plots))
    return plots
