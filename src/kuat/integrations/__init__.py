"""Integrations with training frameworks that do not rebuild ``type(loader)``.

Lightning and Fabric need none: they rebuild a loader as ``type(loader)(**attributes)``, which
gives a kuat loader back (see :mod:`kuat.loader.dataloader`), with the sampler they inject
(their ``DistributedSampler``, ``DistributedSamplerWrapper`` around kuat's own sampler, the
unrepeated one of ``predict``), as for torch's loader: kuat's own sampler is not a
``DistributedSampler`` unless kuat was asked to shard (``docs/distributed.md``, "Frameworks").

An integration reaches the loader through the seams of its face:
``loader._attach_framework(observer_factory, device)`` (a per-epoch
``kuat.loader._plan.EpochObserver``: told when the epoch starts, before its last batch, and
when it ends), ``loader._skip_first_batches(n)``, and, read only, ``loader._options`` (whether
kuat shards it; the arguments kuat resolved, to rebuild it as it was built). The loader's
iterator imports no integration (``tests/test_layering.py``).

* :mod:`kuat.integrations.accelerate`: Hugging Face Accelerate (``Accelerator.prepare`` with
  Accelerate's own sharding applied to kuat's loader,
  ``skip_first_batches``, ``save_state``/``load_state``, gradient accumulation) and the HF
  ``Trainer``, which resumes through Accelerate's ``skip_first_batches``. Installed
  whatever the import order: by ``import kuat`` when Accelerate is loaded, else right after it
  loads (the import hook of :mod:`kuat.integrations._import_hook`).
"""
