"""The README's PyTorch snippet for a machine without a GPU, run as it is written there: its
first ``python`` block after the ``cpu-snippet`` marker, in a fresh interpreter, against a
daemon on its host backend (what ``weightstream serve`` runs without a GPU), found through
``WEIGHTSTREAM_SOCKET`` as a user's ``weightstream serve &`` would be found on its own socket."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[3] / "README.md"


def cpu_snippet() -> str:
    text = README.read_text()
    after = text[text.index("<!-- cpu-snippet -->") :]
    match = re.search(r"```python\n(.*?)```", after, re.S)
    assert match, "a python block follows the cpu-snippet marker"
    return match.group(1)


def test_the_readme_s_cpu_snippet_trains_streamed_steps(daemon):
    snippet = cpu_snippet()
    assert 'wst.attach(model, "cpu"' in snippet and "min_bytes" in snippet
    env = {
        **os.environ,
        "WEIGHTSTREAM_SOCKET": daemon.socket,
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    done = subprocess.run(
        [sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stderr) == (0, "")
    said = re.fullmatch(r"streamed (\d+) bytes\n", done.stdout)
    assert said and int(said.group(1)) > 0, done.stdout
    assert daemon.client.list_models().models == [], "detach(release=True) gave the model back"
