"""kuat doctor TARGET: run a few steps of a loader and say in one line whether the loop waits
for its input, by how much, and which stage to look at (storage, decode, Python/GIL, hand-off,
host-to-device copy), with the numbers (``kuat.doctor``).

TARGET is ``module:function`` or ``path/to/script.py:function``: a function, called with no
arguments, that returns a ``kuat.DataLoader`` (the script's ``if __name__ == "__main__":``
block does not run). ``--step`` names the training step the same way: a function called with
each batch (default: none, how fast the input alone goes).

Exit status 0 when the loop is not input-bound, 3 when it is, 1 on an error.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor",
        help="is a loader's loop input-bound, and which stage to look at",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", help="module:function or script.py:function returning a loader")
    p.add_argument("--steps", type=int, default=50, help="batches to run (default 50)")
    p.add_argument("--step", default=None,
                   help="module:function or script.py:function called with each batch")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON too")
    return p


def load(spec: str):
    """The object ``spec`` (``module:name`` or ``file.py:name``) names.

    Raises:
        KuatError: ``spec`` has no ``:``, or names nothing.
    """
    import importlib
    import importlib.util
    import os
    import sys

    from kuat.errors import KuatError

    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise KuatError(f"expected module:function or script.py:function, got {spec!r}")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise KuatError(f"no such script: {where}")
        mod_name = f"_kuat_doctor_{abs(hash(os.path.abspath(where)))}"
        spec_ = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(spec_)
        sys.modules[mod_name] = module  # (pickling its classes for worker processes)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        spec_.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise KuatError(f"cannot import {where!r}: {e}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise KuatError(f"{where} has no {name!r}") from None


def run(args) -> int:
    import json

    import kuat
    from kuat.errors import KuatError

    loader = load(args.target)()
    if not hasattr(loader, "stats"):
        raise KuatError(f"{args.target} returned a {type(loader).__name__}, not a kuat.DataLoader")
    step = load(args.step) if args.step else None
    if args.steps < 1:
        raise KuatError(f"--steps should be at least 1, got {args.steps}")
    diagnosis = kuat.doctor(loader, steps=args.steps, step_fn=step)
    print(diagnosis.line)
    if args.json:
        print(json.dumps({"input_bound": diagnosis.input_bound,
                          "wait_share": diagnosis.wait_share, "stage": diagnosis.stage,
                          "steps": diagnosis.steps, "numbers": diagnosis.numbers}, default=str))
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return 3 if diagnosis.input_bound else 0
