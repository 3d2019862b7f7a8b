"""Tables and plot of tests/bench/results/flux_train.json (written by flux_train.py runs on the
GPU machine): prints the Markdown tables used in flux_train.md and draws flux_train.png.

    python3 -m tests.bench.flux_report [tests/bench/results/flux_train.json]
(needs matplotlib, which the benchmark itself does not)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GiB = 1 << 30


def modes(run: dict) -> dict:
    return {m["mode"]: m for m in run["modes"]}


def weightstream_rows(run: dict) -> list[dict]:
    """Per budget: s/step, memory, bytes and the lower bound against the same run's resident."""
    resident = modes(run)["resident"]["s_per_step"]
    bandwidth = run["pinned_h2d_gbps"] * 1e9
    rows = []
    for budget, r in modes(run)["weightstream"]["budgets"].items():
        if "s_per_step" not in r:
            rows.append({"budget": float(budget), "error": r.get("error")})
            continue
        bound = max(resident, r["bytes_per_step_gib"] * GiB / bandwidth)
        rows.append(
            {
                "budget": float(budget),
                "s": r["s_per_step"],
                "trainer": r["trainer_reserved_gib"],
                "daemon": round(r["daemon_staging_gib"] + r["daemon_resident_gib"], 2),
                "total": r["gpu_total_gib"],
                "bytes": r["bytes_per_step_gib"],
                "gpu_wait": r.get("gpu_wait_s_per_step"),
                # Results before the rename call it stall.
                "pending": r.get("acquire_pending_s_per_step", r.get("stall_s_per_step")),
                "acquires": r["acquires_per_step"],
                "bound": round(bound, 3),
                "ratio_bound": round(r["s_per_step"] / bound, 2),
                "ratio_resident": round(r["s_per_step"] / resident, 2),
            }
        )
    return rows


def table(run: dict) -> str:
    lines = [
        "| budget GiB | s/step | GPU GiB trainer + daemon = total | GiB H2D/step | "
        "acquires/step | GPU wait s/step | acquire pending s/step | lower bound s | × bound | "
        "× resident |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    res = modes(run)["resident"]
    lines.append(
        f"| resident (none) | {res['s_per_step']:.3f} | {res['trainer_reserved_gib']:.1f} "
        f"(peak allocated {res['trainer_peak_gib']:.1f}) | 0 | – | – | – | "
        f"{res['s_per_step']:.3f} | 1.00 | 1.00 |"
    )
    for r in weightstream_rows(run):
        if "error" in r:
            lines.append(f"| {r['budget']:g} | error: {r['error']} | | | | | | | | |")
            continue
        lines.append(
            f"| {r['budget']:g} | {r['s']:.3f} | {r['trainer']:.2f} + {r['daemon']:.2f} = "
            f"{r['total']:.2f} | {r['bytes']:.1f} | {r['acquires']:.0f} | "
            f"{'–' if r['gpu_wait'] is None else format(r['gpu_wait'], '.3f')} | "
            f"{r['pending']:.3f} | "
            f"{r['bound']:.3f} | {r['ratio_bound']:.2f} | {r['ratio_resident']:.2f} |"
        )
    return "\n".join(lines)


def peers_table(run: dict) -> str:
    m = modes(run)
    resident = m["resident"]["s_per_step"]
    lines = [
        "| mode | s/step | × resident | GPU GiB (reserved) | host RSS GiB "
        "| losses equal resident |",
        "|---|---|---|---|---|---|",
    ]
    for name in (
        "resident",
        "resident-fp8",
        "ramtorch",
        "accelerate-offload",
        "diffusers-group-offload",
        "aitk",
    ):
        r = m.get(name)
        if r is None:
            continue
        if "error" in r:
            error = r["error"][:160].replace("\\n", " ").replace("\n", " ")
            lines.append(f"| {name} | error: `{error}…` | | | | |")
            continue
        equal = r.get("losses_equal_resident", "not checked")
        lines.append(
            f"| {name} | {r['s_per_step']:.3f} | {r['s_per_step'] / resident:.2f} | "
            f"{r['trainer_reserved_gib']:.2f} | {r.get('trainer_rss_gib', '–')} | {equal} |"
        )
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run, style in zip(data["runs"], ("o-", "s--", "^:"), strict=False):
        m = modes(run)
        if "weightstream" in m:
            rows = [r for r in weightstream_rows(run) if "s" in r]
            ax.plot(
                [r["total"] for r in rows],
                [r["s"] for r in rows],
                style,
                color="tab:blue",
                label=f"weightstream (run {run['name']})",
            )
        res = m["resident"]
        ax.plot(
            [res["trainer_peak_gib"]],  # no cap: its reserved memory is the allocator's cache
            [res["s_per_step"]],
            style[0],
            color="black",
            label=f"resident (run {run['name']}, peak allocated)",
        )
        if "ramtorch" in m and "s_per_step" in m["ramtorch"]:
            r = m["ramtorch"]
            ax.plot(
                [r["trainer_reserved_gib"]],
                [r["s_per_step"]],
                "D",
                color="tab:red",
                label=f"ramtorch (run {run['name']})",
            )
        if "accelerate-offload" in m and "s_per_step" in m["accelerate-offload"]:
            r = m["accelerate-offload"]
            ax.annotate(
                f"accelerate cpu_offload: {r['s_per_step']:.1f} s/step (no LoRA gradients)",
                xy=(r["trainer_reserved_gib"], 2.45),
                fontsize=8,
                color="tab:green",
            )
    ax.set_xlabel("GPU memory used by the job, GiB (trainer reserved + daemon)")
    ax.set_ylabel("s/step (median)")
    ax.set_ylim(0, 2.6)
    ax.set_xlim(0, 27)
    ax.set_title("FLUX.1-dev LoRA r=32, 1024², checkpointing, H200")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/bench/results/flux_train.json")
    data = json.loads(path.read_text())
    for run in data["runs"]:
        m = modes(run)
        print(f"## run {run['name']}\n")
        if "weightstream" in m:
            print(table(run), "\n")
        if len(m) > 2 or "weightstream" not in m:
            print(peers_table(run), "\n")
    plot(data, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
