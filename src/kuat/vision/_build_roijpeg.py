"""Build the optional ROI JPEG decoder ``kuat.vision._roijpeg`` from ``_roijpeg.c``.

It needs a C compiler and libjpeg-turbo's development headers (Debian: ``libjpeg62-turbo-dev``
or ``libjpeg-turbo8-dev``); kuat works without it (full-size or DCT-scaled decodes through
simplejpeg), it is only faster with it. ``python -m kuat.vision._build_roijpeg`` builds it next
to this file; :func:`build` can build it elsewhere (the tests build into a temporary folder).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

SOURCE = Path(__file__).with_name("_roijpeg.c")


def build(out_dir: str | Path | None = None) -> Path:
    """Compile ``_roijpeg.c`` into ``out_dir`` (default: this package's folder).

    Returns the path of the built extension module.

    Raises:
        RuntimeError: no C compiler, or the compile failed (its output is in the message).
    """
    cc = shutil.which(
        sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc"
    )
    cc = cc or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (cc/gcc); kuat.vision._roijpeg is optional")
    out_dir = Path(out_dir) if out_dir is not None else SOURCE.parent
    target = out_dir / ("_roijpeg" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [
        cc, "-O2", "-shared", "-fPIC",
        "-I" + sysconfig.get_paths()["include"],
        str(SOURCE), "-ljpeg", "-o", str(target),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building kuat.vision._roijpeg failed: {' '.join(cmd)}\n{proc.stderr}")
    return target


if __name__ == "__main__":
    try:
        path = build()
    except RuntimeError as e:
        print(e, file=sys.stderr)
        raise SystemExit(1) from None
    print(f"built {path}")
