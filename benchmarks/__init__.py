"""``kuat bench``: kuat against torch's DataLoader and the peer loaders, side by side.

Layout (parent process = the ``kuat bench`` command, child = one measured run):

- ``runner.py``    parent: prepares data, creates/reuses peer environments, runs every
                   (loader, workload) pair in its own subprocess, rounds interleaved A B A B ...
                   with nothing sampling memory, then separate memory runs that sample PSS over
                   the child's process tree; aggregates medians, min-max, ratios to every
                   baseline.
- ``worker.py``    child entry point (``python -m benchmarks.worker SPEC OUT``): builds one loader
                   with its adapter, times set-up, first batch and steady-state epochs.
- ``measure.py``   process-tree CPU time and PSS by kind (anonymous, file-backed, shared), used
                   on both sides; also a script: ``python -m benchmarks.measure -- CMD``.
- ``workloads.py`` data sets the workloads read (ImageNet-like JPEGs and their statistics,
                   resized copy, token memmap and the one dataset every loader reads, HF rows).
- ``envs.py``      per-peer virtual environments under ``~/.cache/kuat/bench-envs/<name>``.
- ``report.py``    JSON -> Markdown table (with machine, date and versions) and PNG chart.
- ``headline.py``  JSON -> the README's headline: kuat against torch's strongest configuration
                   per workload, as a table and a PNG chart.
- ``readme.py``    the committed ``results.json`` -> docs/benchmarks.md's results, the README's
                   summary and ``docs/img/headline.png``.
- ``adapters/``    one module per loader; each builds that loader's idiomatic fast configuration.

Adapters run inside the peer's own environment, so this package imports nothing heavy at
module level and depends only on the standard library, numpy, psutil and torch.
"""
