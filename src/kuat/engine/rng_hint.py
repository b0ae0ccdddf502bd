"""Whether a dataset is known, before any of it runs, to draw from torch's global generator.

``worker_type=None`` moves a dataset that draws from the global generators to process workers
(in threads its samples run one at a time under :mod:`kuat.engine.isolate`). Seen only once its
thread workers had fetched and watched their first batches, that move cost a start of
threads, batches fetched twice and a start of processes in the first epoch (torchvision's
``ImageFolder`` with PIL transforms: 0.85x torch over a 0.7 s epoch, docs/benchmarks.md). The
commonest drawing dataset says so in its attributes: a torchvision ``VisionDataset``'s
``transform`` (or ``transforms``, ``target_transform``) holding one of torchvision's random
transforms, which draw from torch's default CPU generator on every call (``torch.rand``,
``torch.randint``: torchvision's ``transforms`` and ``transforms.v2`` sources). Such a dataset
starts on process workers at once.

This is a hint for the worker type only: batches are the same on either type (isolation gives
each sample its draws from ``(seed, epoch, index)``), and the measurement (each worker process
probes its first batch) still decides whether samples run isolated.
"""

from __future__ import annotations

from collections import deque

__all__ = ["draws_hint"]

# torchvision's transforms that draw on every call whose names do not start with "Random"
# (torchvision 0.29: transforms/transforms.py, autoaugment.py, v2/_color.py, _geometry.py,
# _augment.py, _auto_augment.py)
_DRAWING = frozenset({
    "ColorJitter", "GaussianBlur", "GaussianNoise", "ElasticTransform", "AutoAugment",
    "RandAugment", "TrivialAugmentWide", "AugMix", "ScaleJitter", "MixUp", "CutMix",
})
_ATTRS = ("transform", "transforms", "target_transform", "transform_fn")
_WRAPPED = ("dataset", "datasets")  # torch's Subset, ConcatDataset, random_split's Subset
_MAX_NODES = 256  # objects looked at, at most (a hint must cost nothing)


def _drawing_transform(obj) -> str | None:
    cls = type(obj)
    if not cls.__module__.startswith("torchvision.transforms"):
        return None
    name = cls.__name__
    return name if name.startswith("Random") or name in _DRAWING else None


def draws_hint(dataset) -> str | None:
    """The name of the first torchvision random transform ``dataset`` applies (through its
    ``transform``, ``transforms`` or ``target_transform`` attributes, ``Compose`` and the like,
    and torch's ``Subset``/``ConcatDataset`` wrappers), or ``None``.

    Looks at attributes only (calls nothing; at most 256 objects). Thread-safe.
    """
    todo, seen = deque([dataset]), set()  # breadth first: the first transform named
    while todo and len(seen) < _MAX_NODES:
        obj = todo.popleft()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float)):
            continue
        seen.add(id(obj))
        found = _drawing_transform(obj)
        if found is not None:
            return found
        if isinstance(obj, (list, tuple)):
            todo.extend(obj)
            continue
        try:
            attrs = vars(obj)
        except TypeError:  # no __dict__ (slots, builtins)
            continue
        for name in _ATTRS + _WRAPPED:
            value = attrs.get(name)
            if value is not None:
                todo.append(value)
        modules = attrs.get("_modules")  # torch.nn.Sequential / v2 transforms are Modules
        if isinstance(modules, dict):
            todo.extend(modules.values())
    return None
