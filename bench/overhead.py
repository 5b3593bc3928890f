"""The worker's own overhead, as ratios against the plainest way to do the same thing, in one run.

1. cold import of handler.py      vs  a bare `import runpod`            (fresh interpreters)
2. dataset preparation            vs  plain unzip + PIL decode + RGB     (same zip, same images)
3. S3Store.upload (verify, meta)  vs  plain boto3 upload_file            (same bytes, same moto server)

`python bench/overhead.py` prints a table and rewrites its section of bench/RESULTS.md.
"""

from __future__ import annotations

import io
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "bench" / "RESULTS.md"
IMPORT_REPEATS = 7
DATASET_IMAGES = 20
DATASET_SIDE = 1024
UPLOAD_BYTES = 64 * 1024**2
UPLOAD_REPEATS = 3


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    timings = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def cold_import(statement: str) -> Callable[[], object]:
    return lambda: subprocess.run([sys.executable, "-c", statement], cwd=REPO_ROOT, check=True)


def photo_like_zip(count: int, side: int) -> bytes:
    """Noisy JPEGs, so decoding costs what real photos cost."""
    import numpy
    from PIL import Image

    generator = numpy.random.default_rng(0)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for index in range(count):
            pixels = generator.integers(0, 255, (side, side, 3), dtype=numpy.uint8)
            image_bytes = io.BytesIO()
            Image.fromarray(pixels).save(image_bytes, format="JPEG", quality=90)
            archive.writestr(f"photo{index}.jpg", image_bytes.getvalue())
    return buffer.getvalue()


def plain_unzip_and_decode(archive_bytes: bytes, target: Path) -> None:
    from PIL import Image

    with zipfile.ZipFile(io.BytesIO(archive_bytes)) as archive:
        archive.extractall(target)
    for path in sorted(target.iterdir()):
        with Image.open(path) as image:
            image.convert("RGB").load()


def measure_dataset(work: Path) -> tuple[float, float]:
    import base64

    from fluxbooth.dataset import prepare_dataset
    from fluxbooth.request.model import parse_request
    from fluxbooth.settings import DatasetLimits

    archive = photo_like_zip(DATASET_IMAGES, DATASET_SIDE)
    request = parse_request(
        {
            "model_name": "bench",
            "dataset": base64.b64encode(archive).decode(),
            "instance_prompt": "a photo of sks",
            "resolution": "1024x1024",
        }
    )
    counter = iter(range(1000))
    ours = median_seconds(lambda: prepare_dataset(request, work / f"job{next(counter)}", DatasetLimits()), 3)
    plain = median_seconds(lambda: plain_unzip_and_decode(archive, work / f"plain{next(counter)}"), 3)
    return ours, plain


def measure_upload(work: Path) -> tuple[float, float]:
    import boto3
    from botocore.config import Config
    from moto.server import ThreadedMotoServer

    from fluxbooth.settings import BucketSettings
    from fluxbooth.storage.artifacts import sha256_file
    from fluxbooth.storage.s3 import S3Store

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        bucket = BucketSettings(
            endpoint_url=f"http://{host}:{port}",
            access_key_id="bench",
            secret_access_key="bench-secret",
            bucket="bench",
            region="us-east-1",
            prefix="bench",
            presign_seconds=3600,
        )
        plain_client = boto3.client(
            "s3",
            endpoint_url=bucket.endpoint_url,
            aws_access_key_id="bench",
            aws_secret_access_key="bench-secret",
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}),
        )
        plain_client.create_bucket(Bucket="bench")
        payload = work / "weights.safetensors"
        payload.write_bytes(os.urandom(UPLOAD_BYTES))
        store = S3Store(bucket, "bench/job")
        # The worker hashes once for the result anyway; the comparison includes it, as a job pays it.
        ours = median_seconds(
            lambda: store.upload(payload, "weights.safetensors", sha256=sha256_file(payload)), UPLOAD_REPEATS
        )
        plain = median_seconds(
            lambda: plain_client.upload_file(str(payload), "bench", "plain/weights.safetensors"), UPLOAD_REPEATS
        )
        return ours, plain
    finally:
        server.stop()


def write_section(table: str, name: str = "overhead") -> None:
    """Replace (or append) the section between this benchmark's markers in bench/RESULTS.md."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    section = f"{start}\n{table}\n{end}"
    if start in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    RESULTS.write_text(text)


def main() -> None:
    import_ours = median_seconds(cold_import("import handler"), IMPORT_REPEATS)
    import_plain = median_seconds(cold_import("import runpod"), IMPORT_REPEATS)
    with tempfile.TemporaryDirectory() as scratch:
        dataset_ours, dataset_plain = measure_dataset(Path(scratch))
        upload_ours, upload_plain = measure_upload(Path(scratch))
    rows = [
        ("cold import: `import handler` vs `import runpod`", import_ours, import_plain),
        (
            f"dataset: prepare_dataset vs unzip + PIL decode ({DATASET_IMAGES} JPEGs, {DATASET_SIDE}²)",
            dataset_ours,
            dataset_plain,
        ),
        (
            f"upload: S3Store.upload (+sha256, verify, presign) vs boto3 upload_file ({UPLOAD_BYTES // 2**20} MiB, moto)",
            upload_ours,
            upload_plain,
        ),
    ]
    lines = [
        "## Worker overhead (`bench/overhead.py`)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; medians.",
        "",
        "| what | fluxbooth (s) | plain (s) | ratio |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {ours:.3f} | {plain:.3f} | {ours / plain:.2f}× |" for name, ours, plain in rows]
    table = "\n".join(lines)
    print(table)
    write_section(table)


if __name__ == "__main__":
    main()
