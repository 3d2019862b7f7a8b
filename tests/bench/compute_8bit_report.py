"""Writes tests/bench/results/compute_8bit.{json,md} from the JSON that flux2_train.py writes
(``--out DIR``: DIR/flux2_train.json, or the file itself): one row per mode and budget, each
with its ratio to the bf16 resident step of the same call (``x_bf16_resident``).

    python3 -m tests.bench.compute_8bit_report OUT/f2/flux2_train.json --card-gib 24 \
        --label h100-25gbps --out tests/bench/results

Rows already in the output JSON under other labels are kept: each call adds its own.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(run: dict, card_gib: float) -> list[dict]:
    """The ``runs`` entries of one flux2_train call."""
    link = run.get("copy_bandwidth_limit")
    if isinstance(link, str):
        from weightstream.sizes import parse_rate

        link = parse_rate("copy_bandwidth_limit", link)
    link_gbps = round(link / 1e9, 1) if link else run.get("pinned_h2d_gbps")
    resident = next((m for m in run["modes"] if m["mode"] == "resident"), None)
    if resident is None:
        raise SystemExit("the call has no resident bf16 mode: no ratio can be given")
    base = resident["s_per_step"]
    out = []
    for m in run["modes"]:
        per_budget = m.get("budgets") or {None: m}
        for budget, r in per_budget.items():
            if "s_per_step" not in r:
                continue
            mode = m["mode"]
            mode = "bf16" if mode == "resident" else mode
            out.append(
                {
                    "model": run.get("model", "flux2"),
                    "mode": f"resident-{mode}" if mode == "bf16" else mode,
                    "compute": m.get("compute", "bf16"),
                    "grad_compute": m.get("grad_compute"),
                    "link_gbps": link_gbps if budget is not None else None,
                    "card_gib": float(budget) if budget is not None else None,
                    "daemon_budget_gib": r.get("daemon_budget_gib"),
                    "s_per_step": r["s_per_step"],
                    "steps_s": r.get("steps_s"),
                    "x_bf16_resident": round(r["s_per_step"] / base, 3),
                    # None where the call compared no losses (--det-steps 0) and for the
                    # reference itself.
                    # (flux_train says True of two empty lists of losses.)
                    "losses_equal_reference": None
                    if m["mode"] == "resident" or not m.get("det_losses", True)
                    else r.get("losses_equal_resident", m.get("losses_equal_resident")),
                }
            )
    return out


def markdown(doc: dict) -> str:
    lines = ["# 8-bit compute: training steps against the bf16 resident step of the same call", ""]
    for label, call in doc["calls"].items():
        lines += [
            f"## {label}",
            "",
            f"`{call['command']}` ({call.get('device', '?')}, {call.get('date', '?')})",
            "",
            "| mode | link GB/s | job GiB | s/step | × bf16 resident | losses equal reference |",
            "|---|---|---|---|---|---|",
        ]
        for r in doc["runs"]:
            if r["label"] != label:
                continue
            lines.append(
                f"| {r['mode']} | {r['link_gbps'] or '–'} | {r['card_gib'] or '–'} | "
                f"{r['s_per_step']:.3f} | {r['x_bf16_resident']:.3f} | "
                f"{r['losses_equal_reference']} |"
            )
        lines += ["", call.get("commit") or "", "", call.get("note") or "", ""]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path)
    p.add_argument("--card-gib", type=float, default=24)
    p.add_argument("--label", required=True)
    p.add_argument("--device", default="")
    p.add_argument("--note", default="", help="what the call found, in Markdown")
    p.add_argument("--out", type=Path, default=Path("tests/bench/results"))
    args = p.parse_args()
    src = args.source / "flux2_train.json" if args.source.is_dir() else args.source
    run = json.loads(src.read_text())
    path = args.out / "compute_8bit.json"
    doc = json.loads(path.read_text()) if path.exists() else {"calls": {}, "runs": []}
    doc["runs"] = [r for r in doc["runs"] if r["label"] != args.label]
    doc["runs"] += [{"label": args.label, **r} for r in rows(run, args.card_gib)]
    doc["calls"][args.label] = {
        "command": run.get("command"),
        "date": run.get("date"),
        "device": args.device,
        "commit": run.get("commit"),
        "note": args.note,
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / "compute_8bit.md").write_text(markdown(doc))


if __name__ == "__main__":
    main()
