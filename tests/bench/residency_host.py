"""Where the resident groups sit along a pass, on the host backend (no GPU): a model of
``--blocks`` blocks run forward-only under ``no_grad`` at a budget that keeps some of them
resident, the daemon's copies capped at ``--link``, each block's compute on the CPU close to
its copy time, so that the link sets the pace. Per daemon binary (``--bin LABEL=PATH``, e.g.
two builds): the median pass, the link bound (the bytes a pass streams over the cap), the
resident pass (the model in memory), the groups kept resident and the link's idle time from the
daemon's copy timeline (``timeline_gaps``). Outputs equal the model in memory, checked every
pass. Results in ``OUT/residency_host.{json,md}``:

    python3 -m tests.bench.residency_host --bin spread=target/release/weightstream \\
        --bin first=/tmp/weightstream-first --out OUT
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import weightstream.torch as wst
from torch import nn

from tests.bench import timeline_gaps
from tests.bench.provenance import command, commit
from tests.daemon import Daemon


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.a, self.b = nn.Linear(dim, hidden), nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


def run_one(label: str, binary: str, args, ref: nn.Sequential, x: torch.Tensor) -> dict:
    out = Path(args.out) / label
    out.mkdir(parents=True, exist_ok=True)
    log = out / "daemon.log"
    log.unlink(missing_ok=True)
    daemon = Daemon(
        out,
        "--copy-bandwidth-limit",
        args.link,
        binary=binary,
        log_level="warn,weightstream::timeline=debug",
    )
    try:
        model = copy.deepcopy(ref)
        block = sum(p.numel() * p.element_size() for p in ref[-1].parameters())
        budget = int(args.budget_blocks * block * 1.01)
        staging = int(args.staging_blocks * block * 1.01)
        handle = wst.attach(
            model,
            "cpu",
            client=daemon.client,
            min_bytes=0,
            vram_budget=budget,
            staging_bytes=staging,
        )
        groups = handle.session.groups
        resident = [i for i, g in enumerate(groups) if g.resident]
        streamed = sum(g.nbytes for g in groups if not g.resident)
        times = []
        with torch.no_grad():
            want = ref(x)  # once: between the passes the link would get time of its own
            for _ in range(args.passes):
                t = time.perf_counter()
                y = model(x)
                times.append(time.perf_counter() - t)
                assert torch.equal(y, want), "a streamed pass differs from the model in memory"
        handle.detach()
    finally:
        daemon.stop()
    rate = timeline_gaps.parse_rate(args.link)
    link = timeline_gaps.gaps(timeline_gaps.events(log.read_text().splitlines()), rate)
    steady = times[1:]
    return {
        "label": label,
        "binary": binary,
        "resident_groups": resident,
        "streamed_bytes_per_pass": streamed,
        "pass_s": times,
        "median_s": statistics.median(steady),
        "link_bound_s": streamed / rate,
        "link_busy_s": link["busy_s"],
        "link_idle_s": link["idle_s"],
        "idle_per_pass_s": sum(link["idle_s"].values()) / args.passes,
    }


def report(res: dict) -> str:
    lines = [
        "# Resident groups along a pass (host backend)",
        "",
        f"`{res['command']}` at {res['commit']}; {res['blocks']} blocks of "
        f"{res['block_mb']:.1f} MB, a budget of {res['budget_blocks']} blocks of which "
        f"{res['staging_blocks']} staging, the link capped at {res['link']}; the model in "
        f"memory: {res['resident_pass_s']:.3f} s a pass (median).",
        "",
        "| daemon | resident groups | MB streamed / pass | median pass s | link bound s | "
        "× max(bound, in memory) | link idle / pass s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        floor = max(r["link_bound_s"], res["resident_pass_s"])
        lines.append(
            f"| {r['label']} | {r['resident_groups']} | {r['streamed_bytes_per_pass'] / 1e6:.1f} "
            f"| {r['median_s']:.3f} | {r['link_bound_s']:.3f} | {r['median_s'] / floor:.3f} "
            f"| {r['idle_per_pass_s']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", action="append", required=True, help="LABEL=PATH, repeatable")
    ap.add_argument("--out", required=True)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument(
        "--doubles",
        type=int,
        default=0,
        help="blocks of twice the bytes and compute before the others (FLUX's double blocks)",
    )
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=768, help="rows of the input: the compute")
    ap.add_argument("--budget-blocks", type=float, default=19)
    ap.add_argument("--staging-blocks", type=float, default=3)
    ap.add_argument("--link", default="100MB/s")
    ap.add_argument("--passes", type=int, default=8)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    # A double block a little more than two of the others, as FLUX's are (the others' second
    # bias left out), so that two of those fit where one double block goes.
    blocks = [Block(args.dim, 8 * args.dim) for _ in range(args.doubles)]
    blocks += [Block(args.dim, 4 * args.dim, bias=not args.doubles) for _ in range(args.blocks)]
    ref = nn.Sequential(*blocks).requires_grad_(False)
    x = torch.randn(args.tokens, args.dim)
    with torch.no_grad():
        ref(x)
        times = []
        for _ in range(args.passes):
            t = time.perf_counter()
            ref(x)
            times.append(time.perf_counter() - t)
    block = sum(p.numel() * p.element_size() for p in ref[-1].parameters())
    res = {
        "command": command(),
        "commit": commit(),
        "blocks": args.blocks,
        "doubles": args.doubles,
        "block_mb": block / 1e6,
        "budget_blocks": args.budget_blocks,
        "staging_blocks": args.staging_blocks,
        "link": args.link,
        "resident_pass_s": statistics.median(times),
        "runs": [],
    }
    for spec in args.bin:
        label, _, path = spec.partition("=")
        res["runs"].append(run_one(label, path, args, ref, x))
        print(json.dumps(res["runs"][-1]), flush=True)
    out = Path(args.out)
    (out / "residency_host.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "residency_host.md").write_text(report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
