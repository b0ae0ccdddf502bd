"""Only the optional C extension lives here; all metadata is in pyproject.toml.

``kuat.vision._roijpeg`` decodes just the rows and columns of a JPEG that a crop needs
(libjpeg-turbo's skip/crop scanline API). It compiles against libjpeg-turbo's public headers
vendored in ``src/kuat/vision/_libjpeg_turbo`` and links no libjpeg: at import it loads
Pillow's bundled libjpeg-turbo (or the system's; see ``kuat/vision/_libjpeg.py``), so a C
compiler is all it needs. Where even that is missing, the install goes on without it and kuat
decodes through simplejpeg instead (same pixels, slower on large crops).
"""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kuat.vision._roijpeg",
            ["src/kuat/vision/_roijpeg.c"],
            include_dirs=["src/kuat/vision/_libjpeg_turbo/include"],
            depends=[
                f"src/kuat/vision/_libjpeg_turbo/include/{h}"
                for h in ("jpeglib.h", "jconfig.h", "jmorecfg.h", "jerror.h")
            ],
            # dlopen/dlsym and pthreads: in libc from glibc 2.34 and on macOS; libdl and
            # libpthread before that
            libraries=["dl", "pthread"] if sys.platform.startswith("linux") else [],
            # plan_rrc: Python's float results; fetch_rows' helper threads
            extra_compile_args=["-O2", "-ffp-contract=off", "-pthread"],
            optional=True,
        )
    ]
)
