"""``kuat bench``: kuat against torch's DataLoader and the peer loaders, side by side.

Layout (parent process = the ``kuat bench`` command, child = one measured run):

- ``runner.py``    parent: prepares data, creates/reuses peer environments, runs every
                   (loader, workload) pair in its own subprocess, rounds interleaved A B A B ...,
                   samples PSS over the child's process tree, aggregates medians and ratios.
- ``worker.py``    child entry point (``python -m benchmarks.worker SPEC OUT``): builds one loader
                   with its adapter, times set-up, first batch and steady-state epochs.
- ``measure.py``   process-tree CPU time and PSS helpers, used on both sides (psutil only).
- ``workloads.py`` data sets the workloads read (demo JPEGs, resized copy, token memmap, HF rows).
- ``envs.py``      per-peer virtual environments under ``~/.cache/kuat/bench-envs/<name>``.
- ``report.py``    JSON -> Markdown table (with machine, date and versions) and PNG chart.
- ``adapters/``    one module per loader; each builds that loader's idiomatic fast configuration.

Adapters run inside the peer's own environment, so this package imports nothing heavy at
module level and depends only on the standard library, numpy, psutil and torch.
"""
