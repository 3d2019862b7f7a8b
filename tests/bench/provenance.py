"""What a benchmark's results name as the code they measured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """$WS_COMMIT (a machine that runs a copy of the tree may have an older .git), else git's."""
    if os.environ.get("WS_COMMIT"):
        return os.environ["WS_COMMIT"]
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        out = subprocess.run(git, check=False, capture_output=True, text=True, cwd=ROOT)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def command() -> str:
    """The command line that ran this benchmark, as one runs it again from the repository root
    (``python3 -m tests.bench.X ARGS``; ``sys.argv[0]`` is the module's file under ``-m``)."""
    script = Path(sys.argv[0]).resolve()
    try:
        module = ".".join(script.relative_to(ROOT).with_suffix("").parts)
    except ValueError:
        return "python3 " + " ".join(sys.argv)
    return " ".join(["python3", "-m", module, *sys.argv[1:]])


def write_report(out: str | Path, stem: str, report: dict, markdown: str) -> None:
    """``report`` as ``OUT/STEM.json`` and ``markdown`` as ``OUT/STEM.md`` (the folder made),
    the Markdown printed too."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
