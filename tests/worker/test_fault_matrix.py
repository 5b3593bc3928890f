"""One fault per stage of a job, each injected by real means, all on ONE worker (same settings, same process).

| stage     | fault, injected by                                                  | code           |
|-----------|---------------------------------------------------------------------|----------------|
| download  | the dataset's HTTP server drops the connection mid-body             | invalid_dataset|
| unpack    | a tmpfs work disk with room for the archive but not its contents    | does_not_fit   |
| normalise | a tmpfs work disk with room for the contents but not the images     | does_not_fit   |
| cache     | the work disk filled up as the trainer starts caching               | does_not_fit   |
| train     | SIGKILL of the trainer process (found by its run marker) mid-run     | host_oom       |
| export    | the work disk filled up after the last step, before the export      | does_not_fit   |
| validate  | SIGKILL of the trainer once it reports the LoRA exported            | (kept: warning)|
| upload    | the S3 endpoint (moto behind a proxy) drops every upload connection  | upload_failed  |

Each ends with the contract's code and exact message and nothing left in the work directory; the last
test runs the next job on the same worker, which succeeds. The work disk is a real tmpfs, so the tests
mount one (tests.conftest.mounted_tmpfs): they need root (CAP_SYS_ADMIN), skip saying so when they cannot, and
fail instead where FLUXBOOTH_REQUIRE_TMPFS=1 (CI).
The trainer is the real one (`accelerate launch` + DeepSpeed, the tiny model); those tests are slow.
"""

from __future__ import annotations

import asyncio
import errno
import io
import os
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from PIL import Image

from fluxbooth.dataset.images import stored_bytes_bound
from fluxbooth.errors import ErrorCode
from fluxbooth.job.run import run_job
from fluxbooth.job.supervisor import RUN_MARKER_ENV
from fluxbooth.messages import format_bytes
from fluxbooth.models.source import ensure_tiny_model
from fluxbooth.settings import DatasetLimits, WorkerSettings
from tests.conftest import mounted_tmpfs
from tests.support.factories import make_dataset_zip, make_image, make_zip, to_base64
from tests.support.http_fixtures import LocalHTTPServer
from tests.support.s3server import InjectedFault, S3FaultProxy, client_for_env

WORK_DISK_BYTES = 256 * 2**20
PAGE = 4096
# What every stage of dataset preparation keeps free beyond its own bytes (dataset.guards).
DISK_RESERVE_BYTES = 64 * 2**20
STEPS = 3
SECRET_KEY = "fault-matrix-secret-key"

ProgressHook = Callable[[dict[str, Any]], None]


@dataclass
class Worker:
    """One worker's settings over a tmpfs work disk, an S3 endpoint behind a fault proxy, a dataset server."""

    env: dict[str, str]
    disk: Path
    proxy: S3FaultProxy
    http: LocalHTTPServer
    filler: Path = field(init=False)

    def __post_init__(self) -> None:
        self.filler = self.disk / "filler"

    @property
    def work_root(self) -> Path:
        return Path(self.env["FLUXBOOTH_WORK_DIR"])

    def run(self, job_input: dict[str, Any], job_id: str, on_progress: ProgressHook | None = None) -> dict[str, Any]:
        settings = WorkerSettings.from_environ(self.env)
        return asyncio.run(run_job(job_input, job_id=job_id, settings=settings, progress=on_progress))

    def leave_free(self, free_bytes: int) -> None:
        """Fill the work disk (outside the work directory) until `free_bytes` are left."""
        available = shutil.disk_usage(self.disk).free
        with self.filler.open("ab") as filler:
            os.posix_fallocate(filler.fileno(), filler.tell(), max(PAGE, available - free_bytes))

    def fill_up(self) -> None:
        """Fill the work disk to its last page, while the trainer may be writing to it too.

        One allocation of the free space measured a moment earlier fails with ENOSPC when the trainer wrote in
        between, and tmpfs then gives back all of it; so allocate in halving chunks until not a page fits.
        """
        chunk = max(PAGE, shutil.disk_usage(self.disk).free)
        with self.filler.open("ab") as filler:
            while chunk >= PAGE:
                try:
                    os.posix_fallocate(filler.fileno(), os.fstat(filler.fileno()).st_size, chunk)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    chunk //= 2

    def free_again(self) -> None:
        self.filler.unlink(missing_ok=True)

    def leftovers(self) -> list[str]:
        return sorted(str(path.relative_to(self.work_root)) for path in self.work_root.rglob("*"))


@pytest.fixture(scope="module")
def worker(
    tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, torch_extensions_dir: Path, moto_server_url: str
) -> Iterator[Worker]:
    root = tmp_path_factory.mktemp("fault-matrix")
    disk = root / "disk"
    disk.mkdir()
    with mounted_tmpfs(disk, WORK_DISK_BYTES):
        yield from _worker_on(disk, root, model_cache_dir, torch_extensions_dir, moto_server_url)


def _worker_on(
    disk: Path, root: Path, model_cache_dir: Path, torch_extensions_dir: Path, moto_server_url: str
) -> Iterator[Worker]:
    ensure_tiny_model(model_cache_dir)
    proxy = S3FaultProxy(upstream_url=moto_server_url).start()
    http = LocalHTTPServer().start()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(root)),
        "FLUXBOOTH_WORK_DIR": str(disk / "work"),
        "FLUXBOOTH_CACHE_DIR": str(model_cache_dir),
        "FLUXBOOTH_OUTPUT_DIR": str(root / "outputs"),
        "FLUXBOOTH_VOLUME_DIR": str(root / "no-volume"),
        "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "FLUXBOOTH_ALLOW_PRIVATE_URLS": "1",
        "BUCKET_ENDPOINT_URL": proxy.url,
        "BUCKET_NAME": "fault-matrix",
        "BUCKET_REGION": "us-east-1",
        "BUCKET_ACCESS_KEY_ID": "FAULTMATRIXKEY",
        "BUCKET_SECRET_ACCESS_KEY": SECRET_KEY,
        **{name: os.environ[name] for name in ("PYTHONPATH",) if name in os.environ},
    }
    client_for_env({**env, "BUCKET_ENDPOINT_URL": moto_server_url}).create_bucket(Bucket="fault-matrix")
    try:
        yield Worker(env, disk, proxy, http)
    finally:
        http.stop()
        proxy.stop()


@pytest.fixture(autouse=True)
def clean_slate(worker: Worker) -> Iterator[None]:
    """Every fault starts on an empty disk and an honest endpoint, and leaves them so for the next."""
    yield
    worker.free_again()
    worker.proxy.rule = None
    worker.http.routes.clear()


def job_input(**overrides: Any) -> dict[str, Any]:
    return {
        "model_name": "fault-matrix",
        "dataset": to_base64(make_dataset_zip(3, size=(80, 80))),
        "instance_prompt": "a photo of sks toy",
        "base_model": "fluxbooth/tiny-flux",
        "steps": STEPS,
        "resolution": 64,
        "seed": 7,
        **overrides,
    }


def assert_error(result: dict[str, Any], code: ErrorCode, message: str | re.Pattern[str]) -> None:
    assert set(result) == {"error", "refresh_worker"}, result
    assert result["error"]["code"] == code.value, result["error"]
    if isinstance(message, re.Pattern):
        assert message.fullmatch(result["error"]["message"]), result["error"]["message"]
    else:
        assert result["error"]["message"] == message


def on_stage(stage: str, action: Callable[[], None]) -> ProgressHook:
    """A progress sink that runs `action` once, when the job reports `stage` (steps count as "step")."""
    done: list[bool] = []

    def hook(payload: dict[str, Any]) -> None:
        reached = "step" if "step" in payload and "total" in payload else payload.get("stage")
        if reached == stage and not done:
            done.append(True)
            action()

    return hook


def kill_the_trainer() -> None:
    """SIGKILL this test's trainer rank process: a descendant of this process with a run marker that is not
    `accelerate launch` itself (never another test's or another worker's trainer on the same machine)."""
    for process in psutil.Process().children(recursive=True):
        try:
            marked = RUN_MARKER_ENV in process.environ()
            command = " ".join(process.cmdline())
        except psutil.Error:
            continue
        if marked and "fluxbooth.train" in command and "accelerate.commands.launch" not in command:
            process.send_signal(signal.SIGKILL)


# --- the dataset stages ----------------------------------------------------------------------------


def test_download_dropped_mid_body_is_invalid_dataset(worker: Worker) -> None:
    archive = make_dataset_zip(3, size=(80, 80))
    url = worker.http.add("/dataset.zip", body=archive[: len(archive) // 2], content_length=len(archive))
    request = {key: value for key, value in job_input(dataset_url=url).items() if key != "dataset"}

    result = worker.run(request, "download-fault")

    assert_error(
        result,
        ErrorCode.INVALID_DATASET,
        f"dataset_url: {url} promised {len(archive):,} bytes but sent {len(archive) // 2:,}; try again",
    )
    assert worker.leftovers() == []


def noisy_photos(count: int, side: int) -> list[tuple[str, bytes]]:
    """JPEGs of noise: they do not deflate, so an archive of them unpacks to about its own size."""
    members = []
    for index in range(count):
        bands = [Image.effect_noise((side, side), 40 + 10 * band + index) for band in range(3)]
        buffer = io.BytesIO()
        Image.merge("RGB", bands).save(buffer, format="JPEG", quality=90)
        members.append((f"photo{index}.jpg", buffer.getvalue()))
    return members


def test_unpack_on_a_full_disk_is_does_not_fit(worker: Worker) -> None:
    members = noisy_photos(3, 600)
    archive, unpacked = make_zip(members), sum(len(body) for _, body in members)
    # Room to store the archive, not to unpack it beside it.
    worker.leave_free(len(archive) + DISK_RESERVE_BYTES + unpacked // 2)

    result = worker.run(job_input(dataset=to_base64(archive)), "unpack-fault")

    assert_error(
        result,
        ErrorCode.DOES_NOT_FIT,
        re.compile(
            rf"disk: extracting the dataset needs about {re.escape(format_bytes(unpacked + DISK_RESERVE_BYTES))} "
            r"but only [\d.]+ MiB are free under \S+; free disk space, use a bigger volume or a smaller dataset"
        ),
    )
    assert worker.leftovers() == []


def on_disk(size: int) -> int:
    """The bytes a file of `size` takes on the tmpfs (whole pages)."""
    return -(-size // PAGE) * PAGE


def test_normalise_on_a_full_disk_is_does_not_fit(worker: Worker) -> None:
    # Flat JPEGs: a small archive, while a normalised image is bounded by its incompressible size.
    members = [
        (f"photo{index}.jpg", make_image("JPEG", size=(600, 600), color=(index * 12, 90, 160))) for index in range(20)
    ]
    archive, unpacked = make_zip(members), sum(len(body) for _, body in members)
    stored = len(members) * stored_bytes_bound(600, 600, (64, 64), DatasetLimits().max_image_aspect_ratio)
    # Room to unpack beside the archive; once the archive is gone, no room for the images beside the raw ones.
    enough_to_unpack = on_disk(len(archive)) + unpacked + DISK_RESERVE_BYTES
    too_little_to_normalise = sum(on_disk(len(body)) for _, body in members) + stored + DISK_RESERVE_BYTES
    assert enough_to_unpack < too_little_to_normalise - 2 * PAGE
    worker.leave_free((enough_to_unpack + too_little_to_normalise) // 2)

    result = worker.run(job_input(dataset=to_base64(archive)), "normalise-fault")

    assert_error(
        result,
        ErrorCode.DOES_NOT_FIT,
        re.compile(
            rf"disk: storing the normalised images needs about {re.escape(format_bytes(stored + DISK_RESERVE_BYTES))} "
            r"but only [\d.]+ MiB are free under \S+; free disk space, use a bigger volume or a smaller dataset"
        ),
    )
    assert worker.leftovers() == []


# --- the trainer's stages (the real trainer) -------------------------------------------------------


@pytest.mark.slow
def test_cache_on_a_disk_that_fills_up_is_does_not_fit(worker: Worker) -> None:
    result = worker.run(job_input(), "cache-fault", on_stage("cache", worker.fill_up))

    assert_error(
        result,
        ErrorCode.DOES_NOT_FIT,
        re.compile(
            r"disk: the disk filled up while the trainer was in its cache stage: the plan predicted [\d.]+ [KMG]?i?B for its caches, "
            r"checkpoints and exported weights; free disk space or give the worker a bigger volume \(FLUXBOOTH_WORK_DIR\)"
        ),
    )
    assert worker.leftovers() == []


@pytest.mark.slow
def test_train_killed_is_host_oom(worker: Worker) -> None:
    result = worker.run(job_input(), "train-fault", on_stage("step", kill_the_trainer))

    assert_error(
        result,
        ErrorCode.HOST_OOM,
        re.compile(
            rf"the trainer was killed after step \d/{STEPS}, most likely by the kernel's out-of-memory killer: host RAM "
            r"ran out \(the plan predicted [\d.]+ [MG]iB\); use a worker with more RAM, training_type lora, or offload "
            r"nvme with zero_stage 3"
        ),
    )
    assert worker.leftovers() == []


# Steps of the export fault's run: enough that a step is reported before the last one (the worker reports steps at
# most every PROGRESS_MIN_INTERVAL_SECONDS, the last always).
EXPORT_FAULT_STEPS = 12


@pytest.mark.slow
def test_export_on_a_disk_that_fills_up_is_does_not_fit(worker: Worker) -> None:
    # Filled at the first step reported before the last: the trainer does not wait for the worker to read its events,
    # so at the last step's report the tiny LoRA is often exported already. The steps write nothing to disk.
    filled_at: list[int] = []

    def before_the_last_step(payload: dict[str, Any]) -> None:
        step = payload.get("step") if payload.get("stage") == "train" else None
        if isinstance(step, int) and 0 < step < EXPORT_FAULT_STEPS and not filled_at:
            filled_at.append(step)
            worker.fill_up()

    result = worker.run(job_input(steps=EXPORT_FAULT_STEPS), "export-fault", before_the_last_step)

    assert filled_at, "no step was reported before the last"
    assert_error(
        result,
        ErrorCode.DOES_NOT_FIT,
        re.compile(
            r"disk: the disk filled up while the trainer was in its (save|export) stage after step "
            rf"{EXPORT_FAULT_STEPS}/{EXPORT_FAULT_STEPS}: the plan predicted [\d.]+ [KMG]?i?B for its caches, "
            r"checkpoints and exported weights; free disk space or give the worker a bigger volume \(FLUXBOOTH_WORK_DIR\)"
        ),
    )
    assert worker.leftovers() == []


@pytest.mark.slow
def test_trainer_killed_during_its_final_renders_keeps_and_uploads_the_exported_lora(worker: Worker) -> None:
    killed: list[bool] = []

    def once_exported(payload: dict[str, Any]) -> None:
        if payload.get("stage") == "export" and payload.get("status") == "exported" and not killed:
            killed.append(True)
            kill_the_trainer()

    # Eight final renders: seconds of work after the export, so the kill lands in them.
    prompts = [f"a photo of sks toy, scene {number}" for number in range(8)]
    result = worker.run(job_input(validation_prompts=prompts), "render-fault", once_exported)

    assert killed, "the trainer never reported its export"
    assert "error" not in result, result
    names = [artifact["name"] for artifact in result["artifacts"]]
    assert {"lora/pytorch_lora_weights.safetensors", "lora/lora_comfyui.safetensors"} <= set(names)
    assert not [name for name in names if name.startswith("validation/validation_")], "the renders finished first"
    (warning,) = [text for text in result["warnings"] if text.startswith("the trainer failed after")]
    assert re.fullmatch(
        # The kill comes as the export ends: the trainer may or may not have announced its final renders.
        r"the trainer failed after exporting the weights(, in its validate stage)? \(host_oom: the trainer was killed "
        rf"after step {STEPS}/{STEPS}, most likely by the kernel's out-of-memory killer: host RAM ran out \(the plan "
        r"predicted [\d.]+ [MG]iB\); use a worker with more RAM, training_type lora, or offload nvme with zero_stage 3\); "
        r"the exported weights are kept and uploaded, without the final validation renders",
        warning,
    ), warning
    assert result["metrics"]["failed_after_export"] == "host_oom"
    assert worker.leftovers() == []


# --- upload, and the next job -----------------------------------------------------------------------


@pytest.mark.slow
def test_upload_through_dropped_connections_is_upload_failed(worker: Worker) -> None:
    worker.proxy.fail_always(lambda request: request.method in {"PUT", "POST"}, InjectedFault(drop_connection=True))

    result = worker.run(job_input(), "upload-fault")

    assert_error(result, ErrorCode.UPLOAD_FAILED, re.compile(r"uploading s3://fault-matrix/\S+ failed: .*"))
    assert SECRET_KEY not in str(result)
    assert worker.leftovers() == []


@pytest.mark.slow
def test_after_every_fault_the_next_job_on_the_same_worker_succeeds(worker: Worker) -> None:
    result = worker.run(job_input(), "after-the-faults")

    assert "error" not in result, result
    assert [artifact["uri"].startswith("s3://fault-matrix/") for artifact in result["artifacts"]] == [True] * len(
        result["artifacts"]
    )
    assert worker.leftovers() == []
