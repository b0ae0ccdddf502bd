"""Integrations with training frameworks that do not rebuild ``type(loader)``.

Lightning and Fabric need none: they rebuild a loader as ``type(loader)(**attributes)``, which
gives a kuat loader back (see :mod:`kuat.loader`, "Seams with frameworks"), and kuat's own
sampler is a ``DistributedSampler``, so they inject none.

* :mod:`kuat.integrations.accelerate`: Hugging Face Accelerate (``Accelerator.prepare``,
  ``skip_first_batches``, ``save_state``/``load_state``, gradient accumulation) and the HF
  ``Trainer``, which resumes through Accelerate's ``skip_first_batches``. Installed
  automatically when a ``kuat.DataLoader`` is built while ``accelerate`` is imported.
"""
