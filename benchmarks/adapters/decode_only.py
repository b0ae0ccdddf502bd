"""The full-size decode reference: every file decoded at full size, on all cores, nothing else.

Each epoch reads and decodes every JPEG of the ImageFolder to ``(H, W, 3)`` uint8 RGB with
simplejpeg (libjpeg-turbo, GIL released) in a thread pool of ``os.cpu_count()`` threads: no
crop, resize, flip, collate or loader. A loader that decodes full-size images cannot beat this
rate on the same cores; one that decodes at a reduced DCT scale or only the crop can, so it
is a reference point, not a limit. In ``imagenet-jpeg-256`` it decodes the resized files kuat
stores (exported once by :func:`benchmarks.workloads.resized_imagefolder`).
"""

from __future__ import annotations

from benchmarks.adapters import Loader, list_imagefolder, num_workers

WORKLOADS = ("imagenet-jpeg", "imagenet-jpeg-256")  # -256: the exported resized files
CHUNK = 64


def versions() -> dict[str, str]:
    import simplejpeg

    return {"simplejpeg": simplejpeg.__version__}


def count(chunk: int) -> int:
    return chunk


def build(workload: str, data: dict, spec: dict) -> Loader:
    from concurrent.futures import ThreadPoolExecutor

    import simplejpeg

    files, _, _ = list_imagefolder(data["root"])
    pool = ThreadPoolExecutor(num_workers(spec), thread_name_prefix="decode-only")

    def decode(path: str) -> int:
        with open(path, "rb") as f:
            img = simplejpeg.decode_jpeg(f.read(), colorspace="RGB")  # (H, W, 3) uint8
        return img.shape[0]

    def epoch(e):
        n = 0
        for _ in pool.map(decode, files):  # all files queued at once: no idle core between chunks
            n += 1
            if n == CHUNK:
                yield n
                n = 0
        if n:
            yield n

    return Loader(epoch, lambda: pool.shutdown(wait=True))
