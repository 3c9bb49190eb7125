"""Charts of benchmarks/results/peers/*.json: output tokens/s and TTFT p50 per workload per engine.

Invariant: the charts are derived from the result files alone (regenerate, never hand-edit).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from benchmarks.paths import DOCS, PEER_RESULTS

IMAGES = DOCS / "img"


def label(result: dict) -> str:
    """Engine name plus what distinguishes its runs (bf16 compute, prefix caching off)."""
    name = result["engine"]
    options = result.get("options") or {}
    if options.get("dtype") == "bfloat16":
        name += " bf16"
    if options.get("enable_prefix_caching") is False or options.get("prefix_caching") is False \
            or ("prompt_cache" in options and options["prompt_cache"] is None):
        name += " (no prefix cache)"
    return name


def load_results(mode: str = "offline") -> dict[str, dict[str, dict]]:
    """workload -> engine label -> result, for one mode."""
    table: dict[str, dict[str, dict]] = defaultdict(dict)
    for path in sorted(PEER_RESULTS.glob("*.json")):
        result = json.loads(path.read_text())
        # A sitting's summary (a note and its engines' results) is not one run: not charted.
        if result.get("mode") == mode and "workload" in result:
            table[result["workload"]][label(result)] = result
    return dict(sorted(table.items()))


def bar_chart(table: dict[str, dict[str, dict]], metric: str, ylabel: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(table)
    engines = sorted({e for per in table.values() for e in per})
    width = 0.8 / max(1, len(engines))
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(workloads) + 2), 4))
    for i, engine in enumerate(engines):
        # Only workloads the engine ran get a bar: a missing run is no bar, never a zero.
        ran = [(j, table[w][engine][metric]) for j, w in enumerate(workloads) if engine in table[w]]
        bars = ax.bar([j + i * width for j, _ in ran], [v for _, v in ran], width, label=engine)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks([j + width * (len(engines) - 1) / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.set_title(f"{ylabel} (offline, all requests at once)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> list[Path]:
    table = load_results("offline")
    if not table:
        print(f"no results under {PEER_RESULTS}")
        return []
    try:
        import matplotlib  # noqa: F401  (the `bench` extra)
    except ImportError:
        print("charts skipped: matplotlib is not installed (pip install -e '.[bench]')")
        return []
    paths = [IMAGES / "bench_throughput.png", IMAGES / "bench_ttft.png"]
    bar_chart(table, "output_tok_s", "output tokens/s", paths[0])
    bar_chart(table, "ttft_p50_s", "TTFT p50 (s)", paths[1])
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    main()
