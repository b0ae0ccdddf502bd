"""Only the optional C extension lives here; all metadata is in pyproject.toml.

``kuat.vision._roijpeg`` decodes just the rows and columns of a JPEG that a crop needs
(libjpeg-turbo's skip/crop scanline API). It needs a C compiler and libjpeg(-turbo) headers
(Debian: libjpeg62-turbo-dev). Where it cannot be built, the install goes on without it and
kuat decodes through simplejpeg instead (same pixels, slower on large crops).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kuat.vision._roijpeg",
            ["src/kuat/vision/_roijpeg.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
