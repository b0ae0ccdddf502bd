"""Fault injection for the Ray conversion tests, installed in every Ray worker of the test's
job by ``worker_process_setup_hook`` (the library has no test hooks of its own).

It wraps :meth:`kuat.Writer.close` in the worker processes, keyed on the directory a part
task writes (``.<dst name>.kuat-ray/part-NNNNN``), or on the URL of one
(``<scheme>://.../<dst name>/part-NNNNN``) when the job's workers have ``KUAT_TEST_GATES``
(a local folder that stands in for the destination's parent below) in their environment:

- a destination whose name contains ``flaky``: the first close of each part raises
  ``OSError`` (a storage hiccup), so Ray must retry the task; ``<staging>/../<dst>.failed``
  counts the injected failures (one empty file per part).
- a destination whose name contains ``gated``: every part after part 0 waits (at most
  60 s) for a file ``<dst>.gate`` before closing, so a test can kill the driver while part 0
  is written and the others are not.
- a destination whose name contains ``spread``: each part records the Ray node it was
  written on in ``<dst>.nodes/<part>``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def _dst_of(part_dir: Path | str) -> Path | None:
    if "://" in str(part_dir):  # a part written in place at a URL destination
        gates = os.environ.get("KUAT_TEST_GATES")
        return Path(gates, str(part_dir).rstrip("/").split("/")[-2]) if gates else None
    staging = Path(part_dir).parent
    if not (staging.name.startswith(".") and staging.name.endswith(".kuat-ray")):
        return None
    return staging.parent / staging.name[1 : -len(".kuat-ray")]


def install() -> None:
    from kuat.format import writer

    original = writer.Writer.close

    def close(self):
        dst = _dst_of(self.path)
        if dst is not None and not self._closed:
            part = str(self.path).rstrip("/").rsplit("/", 1)[-1]
            if "flaky" in dst.name:
                failed = dst.parent / f"{dst.name}.failed"
                failed.mkdir(exist_ok=True)
                try:
                    os.close(os.open(failed / part, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    pass  # the retry: write normally
                else:
                    self.abort()
                    raise OSError(f"injected storage failure writing {self.path}")
            if "gated" in dst.name and part != "part-00000":
                gate = dst.parent / f"{dst.name}.gate"
                deadline = time.monotonic() + 60
                while not gate.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)  # a test fixture's gate, not library synchronisation
            if "spread" in dst.name:
                import ray

                nodes = dst.parent / f"{dst.name}.nodes"
                nodes.mkdir(exist_ok=True)
                (nodes / part).write_text(ray.get_runtime_context().get_node_id())
        return original(self)

    writer.Writer.close = close
