"""What every loader must hand the consumer, per workload (so no loader does less work).

- ``imagenet-jpeg`` / ``imagenet-jpeg-256``: ``{"image": (B, 3, 224, 224) torch.uint8,
  "label": (B,) torch.int64}`` (any memory format: FFCV's channels-last view counts).
- ``tokens``: ``{"tokens": (B, 1025) torch.int64}``.
- ``hf-rows``: ``{"input_ids": (B, L) torch tensor, "label": (B,) torch.int64, ...}``.
- ``decode-only`` adapters report per-chunk counts and are not checked.
"""

from __future__ import annotations

IMAGE_SIZE = 224
TOKEN_WINDOW = 1025


def _desc(t) -> str:
    return f"{type(t).__name__}{tuple(getattr(t, 'shape', ()))}:{getattr(t, 'dtype', '?')}"


def check_batch(workload: str, batch, spec: dict) -> dict:
    """Validate one batch of ``workload``; returns ``{field: "Tensor(shape):dtype"}``.

    Raises:
        ValueError: a field is missing or has the wrong type, shape or dtype.
    """
    import torch

    if spec.get("adapter") == "decode_only":
        return {"chunk": repr(batch)}
    if not isinstance(batch, dict):
        raise ValueError(f"{spec.get('loader')}: batch must be a dict, got {type(batch)}")
    b = spec["batch_size"]
    if workload.startswith("imagenet-jpeg"):
        want = {
            "image": ((b, 3, IMAGE_SIZE, IMAGE_SIZE), torch.uint8),
            "label": ((b,), torch.int64),
        }
    elif workload == "tokens":
        want = {"tokens": ((b, TOKEN_WINDOW), torch.int64)}
    elif workload == "hf-rows":
        want = {"label": ((b,), torch.int64)}
    else:
        raise ValueError(f"unknown workload={workload!r}")
    for field, (shape, dtype) in want.items():
        t = batch.get(field)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"{spec.get('loader')} on {workload}: field {field!r} must be a {dtype} tensor "
                f"of shape {shape}, got {_desc(t)}"
            )
    return {k: _desc(v) for k, v in batch.items()}
