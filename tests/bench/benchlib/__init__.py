"""The shared code of the FLUX training benchmarks (tests/bench/flux_train.py and the scripts
that train the same model): ``flux`` (the models, LoRA, batch and step), ``modes`` (the
weightstream and resident modes, their timing and probes), ``baselines`` (the in-process peers)
and ``runner`` (the parent, the daemon and the children); ``first_step_parts`` and
``first_step_report`` (tests/bench/first_step.py's child parts and its table). Imported as
``tests.bench.benchlib``: run the benches from the repository root as
``python -m tests.bench.X``."""
