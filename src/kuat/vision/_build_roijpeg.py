"""Build the optional ROI JPEG decoder ``kuat.vision._roijpeg`` from ``_roijpeg.c``.

It needs a C compiler only: the module compiles against libjpeg-turbo's public headers
vendored in ``_libjpeg_turbo/include`` and links no libjpeg (``kuat.vision._libjpeg`` loads
Pillow's bundled libjpeg-turbo, or the system's, at import). kuat works without it (full-size
or DCT-scaled decodes through simplejpeg), it is only faster with it.
``python -m kuat.vision._build_roijpeg`` builds it next to this file; :func:`build` can build
it elsewhere (the tests build into a temporary folder).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

SOURCE = Path(__file__).with_name("_roijpeg.c")
INCLUDE = Path(__file__).with_name("_libjpeg_turbo") / "include"  # vendored jpeglib.h & co


def compiler() -> str:
    """The C compiler Python was built with (``CC``), else ``cc``/``gcc`` on ``PATH``.

    Raises:
        RuntimeError: none found.
    """
    cc_var = sysconfig.get_config_var("CC")
    cc = shutil.which(cc_var.split()[0] if cc_var else "cc") or shutil.which("cc")
    cc = cc or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (cc/gcc); kuat.vision._roijpeg is optional")
    return cc


def compile_flags(include: str | Path = INCLUDE) -> list[str]:
    """Preprocessor flags: Python's headers, then the libjpeg headers in ``include`` (the
    vendored ones by default; these come before any system ``jpeglib.h``)."""
    return ["-I" + sysconfig.get_paths()["include"], "-I" + str(include)]


def build(out_dir: str | Path | None = None, *, include: str | Path = INCLUDE) -> Path:
    """Compile ``_roijpeg.c`` into ``out_dir`` (default: this package's folder) against the
    libjpeg headers in ``include`` (default: the vendored libjpeg-turbo 3.1.2 headers).

    Returns the path of the built extension module.

    Raises:
        RuntimeError: no C compiler, or the compile failed (its output is in the message).
    """
    out_dir = Path(out_dir) if out_dir is not None else SOURCE.parent
    target = out_dir / ("_roijpeg" + sysconfig.get_config_var("EXT_SUFFIX"))
    # dlopen and pthreads: in libc since glibc 2.34, in libdl and libpthread before
    libs = ["-ldl", "-lpthread"] if sys.platform.startswith("linux") else []
    cmd = [
        compiler(), "-O2", "-ffp-contract=off", "-pthread", "-shared", "-fPIC",
        *compile_flags(include), str(SOURCE), *libs, "-o", str(target),
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
