"""Code run under Triton's interpreter (``TRITON_INTERPRET=1``) in a child process, for the
tests that check a kernel's indexing on the CPU: the interpreter is chosen when Triton is
imported, so it needs a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, *args: str, timeout: int = 300) -> list[str]:
    """The lines ``code`` (run as ``python -c code args``, from the repository's root, with it
    and the client's sources on the path) prints under the interpreter; fails the test with
    the end of its stderr where it exits with an error."""
    path = [str(ROOT), str(ROOT / "client-py" / "src"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in path if p))
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.splitlines()
