"""The counters of one pass of the packer, behind :meth:`kuat.text.Packed.stats`.

Every part of a pass (the in-order packers, the plan, the assembly of planned rows) adds to
the same :class:`PackStats`; :class:`~kuat.text.pack._plan.SharedPlan` replays a buffer's
counts to each reader by the names in ``PackStats.COUNTS``.
"""

from __future__ import annotations

__all__ = ["PackStats"]


class PackStats:
    """Counters of one pass of a packer (see :meth:`Packed.stats`)."""

    COUNTS = (
        "documents",
        "tokens",
        "rows",
        "pad_tokens",
        "split_documents",
        "dropped_documents",
        "dropped_tokens",
        "read_documents",
        "read_tokens",
    )
    __slots__ = COUNTS + ("seq_len",)

    def __init__(self, seq_len: int = 0):
        for name in self.COUNTS:
            setattr(self, name, 0)
        self.seq_len = seq_len

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.COUNTS}
        slots = self.rows * self.seq_len
        out["padding_fraction"] = self.pad_tokens / slots if slots else 0.0
        return out
