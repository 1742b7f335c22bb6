"""Regenerate BENCHMARKS.md's section on emulated links (tables + PNG plots) from benchmarks/results/.

    python benchmarks/report.py
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
RESULTS, PLOTS, DOC = HERE / "results", HERE / "plots", HERE / "BENCHMARKS.md"
BEGIN, END = "<!-- emulated-links:begin (benchmarks/report.py) -->", "<!-- emulated-links:end -->"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def link_label(data: dict, env: str) -> str:
    """"100 Mbit/s, 40 ms" from the environment table saved with the results."""
    if env not in data.get("links", {}):
        return ""
    rate, delay = data["links"][env]
    bandwidth = f"{rate / 1e9:g} Gbit/s" if rate >= 1e9 else f"{rate / 1e6:g} Mbit/s"
    return f"{bandwidth}, {delay * 1000:g} ms"


def envs_section(data: dict) -> list[str]:
    rows = {(r["env"], r["config"]): r for r in data["rows"]}
    lines = [f"Measured {data['date']} on {data['machine']}. Every link of the 3-stage ring and the entry",
             "carries the environment's bandwidth and one-way delay (`tests/linkemu.py`).", "",
             "| env | links | batch tok/s baseline | batch tok/s beeswarm | ratio | decode tok/s baseline | "
             "decode tok/s beeswarm | TTFT 512 baseline | TTFT 512 beeswarm | wire/raw beeswarm |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for env in sorted({e for e, _ in rows}):
        b, s = rows.get((env, "baseline")), rows.get((env, "beeswarm"))
        if not (b and s):
            continue
        ratio = s["batch_tokens_per_s"] / b["batch_tokens_per_s"]
        packed = s["wire_bytes"] / s["raw_bytes"] if s["raw_bytes"] else 1.0
        lines.append(f"| {env} | {link_label(data, env)} | {b['batch_tokens_per_s']:.2f} | "
                     f"{s['batch_tokens_per_s']:.2f} | "
                     f"{ratio:.2f}x | {b['decode_tokens_per_s']:.2f} | {s['decode_tokens_per_s']:.2f} | "
                     f"{b['ttft_s']:.2f} s | {s['ttft_s']:.2f} s | {packed:.3f} |")
    lines += ["", "![batch throughput per environment](plots/throughput.png)", ""]
    return lines


def ring_section(data: dict) -> list[str]:
    lines = ["Single-stream decode through the same swarm (push chain, no speculation), the ring's one-way",
             "latency split evenly over its 4 links; analytical `1 / (C + T_ring)` with C measured at 0 ms.",
             f"Measured {data['date']}.", "",
             "| ring one-way (ms) | measured tok/s | analytical tok/s | measured / analytical |",
             "|---:|---:|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['ring_ms']} | {r['decode_tokens_per_s']:.2f} | {r['analytical_tokens_per_s']:.2f} | "
                     f"{r['decode_tokens_per_s'] / r['analytical_tokens_per_s']:.3f} |")
    lines += ["", "![ring sweep](plots/ring.png)", ""]
    return lines


def plot_envs(data: dict) -> None:
    import matplotlib.pyplot as plt

    rows = {(r["env"], r["config"]): r for r in data["rows"]}
    envs = sorted({e for e, _ in rows if (e, "baseline") in rows and (e, "beeswarm") in rows})
    base = [rows[(e, "baseline")]["batch_tokens_per_s"] for e in envs]
    ours = [rows[(e, "beeswarm")]["batch_tokens_per_s"] for e in envs]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = range(len(envs))
    ax.bar([i - 0.2 for i in x], base, 0.4, label="baseline (client hops, raw, M = 1)")
    ax.bar([i + 0.2 for i in x], ours, 0.4, label="beeswarm (push, codec, planned M)")
    for i, (b, s) in enumerate(zip(base, ours)):
        ax.annotate(f"{s / b:.2f}x", (i + 0.2, s), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"{e}\n{link_label(data, e)}" for e in envs], fontsize=8)
    ax.set_ylabel("batch tokens/s (8 sequences)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "throughput.png", dpi=110)
    plt.close(fig)


def plot_ring(data: dict) -> None:
    import matplotlib.pyplot as plt

    rows = data["rows"]
    ring = [r["ring_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    compute = 1 / rows[0]["analytical_tokens_per_s"]  # C, measured at the 0 ms ring
    dense = [max(ring) * i / 200 for i in range(201)]
    ax.plot(dense, [1 / (compute + t / 1000) for t in dense], "-",
            label=f"1 / (C + T_ring), C = {compute * 1000:.0f} ms")
    ax.plot(ring, [r["decode_tokens_per_s"] for r in rows], "o", label="measured")
    ax.set_xlabel("ring one-way latency (ms)")
    ax.set_ylabel("single-stream decode tokens/s")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOTS / "ring.png", dpi=110)
    plt.close(fig)


def render() -> None:
    import matplotlib

    matplotlib.use("Agg")
    PLOTS.mkdir(exist_ok=True)
    lines = ["## Emulated internet links (`python benchmarks/swarm_bench.py --scenario all`)", ""]
    envs, ring = load("envs"), load("ring")
    if envs:
        plot_envs(envs)
        lines += ["### Scenarios E1-E5, 8 sequences of the `wide` model", ""] + envs_section(envs)
    if ring:
        plot_ring(ring)
        lines += ["### Ring sweep", ""] + ring_section(ring)
    block = "\n".join([BEGIN, *lines, END])
    doc = DOC.read_text()
    if BEGIN in doc:
        doc = doc[:doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    DOC.write_text(doc)


if __name__ == "__main__":
    render()
