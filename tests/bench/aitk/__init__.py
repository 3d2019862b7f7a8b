"""The ai-toolkit benchmarks' code (tests/bench/ai_toolkit_real.py and ai_toolkit_24g.py, which
run ai-toolkit's real ``run.py``): ``build`` and ``build_24g`` (the models, data and YAML they
train), ``measure`` (one run and what is measured of it), ``runs_24g`` (the runs the 24 GB
bench is told to make), ``cgroup`` (the memory cgroup of its ``--host-limit-gib``),
``report`` and ``report_24g`` (their checks and reports). Imported as
``tests.bench.aitk``: run the benches from the repository root as ``python -m tests.bench.X``."""
