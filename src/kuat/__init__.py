"""kuat: a fast, drop-in data loader for PyTorch training.

Public names are loaded lazily, so ``import kuat`` stays cheap and a command such as
``kuat inspect`` does not pay for importing torch.

    import kuat
    ds = kuat.open("train.kuat")
    loader = kuat.DataLoader(ds, batch_size=64, shuffle=True, num_workers=8)
"""

from __future__ import annotations

import importlib

from kuat.integrations import _import_hook

__version__ = "0.1.0"

# public name -> module that defines it, or (module, its name there)
_EXPORTS = {
    # errors
    "KuatError": "kuat.errors",
    "FormatError": "kuat.errors",
    "SchemaError": "kuat.errors",
    "DecodeError": "kuat.errors",
    "WorkerError": "kuat.errors",
    "LoaderTimeoutError": "kuat.errors",
    "SharedMemoryError": "kuat.errors",
    "RemoteError": "kuat.errors",
    "MissingDependencyError": "kuat.errors",
    "ReplicaMismatchError": "kuat.replicas",
    # randomness
    "sample_rng": "kuat.rng",
    "SampleRNG": "kuat.rng",
    # format (storage) and the kuat source (what kuat.open returns)
    "Writer": "kuat.format",
    "Dataset": "kuat.sources.dataset",
    "open": ("kuat.sources.dataset", "open_dataset"),
    "Schema": "kuat.format",
    "Field": "kuat.format",
    # loader
    "DataLoader": "kuat.loader",
    "ShardShuffleSampler": "kuat.shard_sampling",
    "default_collate": "kuat.collate",
    "pad_collate": "kuat.padding",
    # sources
    "mix": "kuat.sources",
    "shuffle_buffer": "kuat.sources",
    "check_resume": "kuat.testing",
    # diagnostics: is the loop input-bound, and where
    "doctor": ("kuat._doctor", "doctor"),
    # text: packing and token-budget batching
    "pack": "kuat.text",
    "pack_collate": "kuat.text",
    "TokenBudgetBatchSampler": "kuat.text",
    # vision helpers most users need at top level
    "probe_image": "kuat.vision.probe",
}

# Accelerate's prepare_data_loader/skip_first_batches route kuat loaders to kuat whatever the
# import order (installed now if Accelerate is loaded, else by an import hook; imports neither)
_import_hook.watch()

__all__ = sorted(_EXPORTS) + ["__version__", "vision", "convert", "text"]


def __getattr__(name: str):
    if name in ("vision", "convert", "text"):
        return importlib.import_module(f"kuat.{name}")
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'kuat' has no attribute {name!r}") from None
    module, attr = module if isinstance(module, tuple) else (module, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__():
    return __all__
