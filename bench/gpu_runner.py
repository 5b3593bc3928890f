"""One measured run of the worker for bench/gpu.py: the plan's prediction, then `python -m fluxbooth train`
with NVML and host-memory samplers beside it, its events parsed into phases and step times.

Nothing here shortcuts the worker: the request goes through the same CLI a user runs, which validates
it, plans, prepares the dataset, launches the trainer under accelerate + DeepSpeed and exports.
"""

from __future__ import annotations

import io
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from fluxbooth.contract.events import EVENT_MARKER

# launch.py logs each trainer event as "trainer event | {json}"; the raw marker is accepted too.
EVENT_PREFIXES = ("trainer event | ", EVENT_MARKER)


@dataclass(frozen=True)
class RunSpec:
    """One run: its request fields, the card it emulates (None: the whole GPU) and the model it trains."""

    name: str
    call: int
    purpose: str
    fields: dict[str, Any]
    card_gib: float | None = None
    model: str = "full"
    estimate_seconds: float = 120.0


@dataclass
class RunRecord:
    name: str
    call: int
    purpose: str
    card: str
    base_precision: str
    plan: dict[str, Any] = field(default_factory=dict)
    exit_status: int | None = None
    outcome: str = ""
    gpu_allocated_peak: int | None = None
    gpu_reserved_peak: int | None = None
    nvml_used_peak: int | None = None
    nvml_used_by_phase: dict[str, int] = field(default_factory=dict)
    host_peak: int | None = None
    host_by_phase: dict[str, int] = field(default_factory=dict)
    seconds_per_step: float | None = None
    phase_seconds: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0
    memory_fraction: float | None = None
    transformer_params: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Nvml:
    """NVML through nvidia-ml-py, when a driver is there; None readings otherwise."""

    def __init__(self) -> None:
        self.handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._pynvml = pynvml
        except Exception:  # no nvidia-ml-py or no driver: a CPU machine
            self.handle = None

    def used_bytes(self) -> int | None:
        if self.handle is None:
            return None
        return int(self._pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def total_bytes(self) -> int | None:
        if self.handle is None:
            return None
        return int(self._pynvml.nvmlDeviceGetMemoryInfo(self.handle).total)

    def describe(self) -> dict[str, str]:
        if self.handle is None:
            return {}
        name = self._pynvml.nvmlDeviceGetName(self.handle)
        driver = self._pynvml.nvmlSystemGetDriverVersion()
        return {
            "gpu": name.decode() if isinstance(name, bytes) else str(name),
            "driver": driver.decode() if isinstance(driver, bytes) else str(driver),
        }


class Sampler:
    """Samples NVML used memory and the summed PSS of a process tree until stopped; peaks overall and per phase."""

    def __init__(self, pid: int, nvml: Nvml, interval: float) -> None:
        self._root = psutil.Process(pid)
        self._interval = interval
        self._nvml = nvml
        self.phase = "start"
        self.host_peak = 0
        self.host_by_phase: dict[str, int] = {}
        self.nvml_peak: int | None = None
        self.nvml_by_phase: dict[str, int] = {}
        self._baseline = nvml.used_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _tree_pss(self) -> int:
        try:
            processes = [self._root, *self._root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for process in processes:
            try:
                total += process.memory_full_info().pss
            except psutil.Error:
                continue
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            host = self._tree_pss()
            self.host_peak = max(self.host_peak, host)
            self.host_by_phase[self.phase] = max(self.host_by_phase.get(self.phase, 0), host)
            used = self._nvml.used_bytes()
            if used is not None:
                self.nvml_peak = max(self.nvml_peak or 0, used)
                self.nvml_by_phase[self.phase] = max(self.nvml_by_phase.get(self.phase, 0), used)
            self._stop.wait(self._interval)


def parse_trainer_event(line: str) -> dict[str, Any] | None:
    """The trainer event a worker log line carries, or None."""
    for prefix in EVENT_PREFIXES:
        index = line.find(prefix)
        if index >= 0:
            try:
                payload = json.loads(line[index + len(prefix) :])
            except ValueError:
                return None
            return payload if isinstance(payload, dict) and isinstance(payload.get("event"), str) else None
    return None


class EventLog:
    """Phase boundaries (from stage events, timed on arrival) and step times."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.phase = "worker"
        self.phase_started = self.started
        self.phase_seconds: dict[str, float] = {}
        self.step_seconds: list[float] = []

    def take(self, event: dict[str, Any]) -> str | None:
        """Record `event`; the name of the phase it opens, if any."""
        if event.get("event") == "step" and event.get("seconds_per_step") is not None:
            self.step_seconds.append(float(event["seconds_per_step"]))
        if event.get("event") != "stage" or event.get("stage") == self.phase:
            return None
        self.close()
        self.phase = str(event.get("stage"))
        return self.phase

    def close(self) -> None:
        now = time.monotonic()
        self.phase_seconds[self.phase] = round(self.phase_seconds.get(self.phase, 0.0) + now - self.phase_started, 2)
        self.phase_started = now

    def median_step(self) -> float | None:
        # The first step pays one-off costs (allocator growth, kernel selection): the median of the rest.
        measured = self.step_seconds[1:] or self.step_seconds
        return round(statistics.median(measured), 4) if measured else None


def dataset_zip(count: int, side: int, seed: int = 0) -> bytes:
    """`count` smooth random JPEG photos of `side`² (small to carry, decodable, distinct)."""
    from PIL import Image

    generator = random.Random(seed)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as bundle:
        for index in range(count):
            corner = Image.new("RGB", (2, 2))
            corner.putdata([tuple(generator.randrange(256) for _ in range(3)) for _ in range(4)])
            photo = corner.resize((side, side), Image.Resampling.BILINEAR)
            encoded = io.BytesIO()
            photo.save(encoded, "JPEG", quality=90)
            bundle.writestr(f"photo{index}.jpg", encoded.getvalue())
    return archive.getvalue()


def run_command(
    command: list[str], env: dict[str, str], log_path: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    log_path.write_text(completed.stdout + "\n--- stderr ---\n" + completed.stderr)
    return completed


def predict(request_path: Path, env: dict[str, str], folder: Path) -> dict[str, Any]:
    """`python -m fluxbooth plan --json` for the request, as the worker would plan it here."""
    completed = run_command(
        [sys.executable, "-m", "fluxbooth", "plan", "--json", "--request", str(request_path)],
        env,
        folder / "plan.log",
        300,
    )
    try:
        report = json.loads(completed.stdout)
    except ValueError:
        return {"error": f"plan exited {completed.returncode}: {completed.stderr.strip()[-300:]}"}
    (folder / "plan.json").write_text(json.dumps(report, indent=2) + "\n")
    if report.get("plan") is None:
        error = report.get("error") or {}
        return {"error": f"{error.get('code', 'error')}: {str(error.get('message', report))[:300]}"}
    plan = report["plan"]
    keys = (
        "training_type",
        "use_deepspeed",
        "zero_stage",
        "offload_optimizer",
        "offload_param",
        "base_precision",
        "predicted_gpu_bytes",
        "predicted_host_bytes",
        "predicted_seconds_per_step",
        "cache_encoders_on_cpu",
    )
    return {key: plan[key] for key in keys if key in plan}


def _kill_group(pid: int, record: RunRecord) -> None:
    record.notes.append("killed: past the call's time budget")
    try:
        os.killpg(pid, 9)
    except ProcessLookupError:
        pass


def train(
    request_path: Path,
    env: dict[str, str],
    folder: Path,
    record: RunRecord,
    nvml: Nvml,
    timeout: float,
    interval: float,
) -> dict[str, Any]:
    """Run the worker on the request; fill `record` with what the samplers and events show; the result JSON."""
    events = EventLog()
    started = time.monotonic()
    with (folder / "worker.log").open("w") as log:
        process = subprocess.Popen(
            # --verbose: the worker's log, the trainer's events included, on stderr.
            [sys.executable, "-m", "fluxbooth", "train", str(request_path), "--job-id", record.name, "--verbose"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        stdout_chunks: list[str] = []
        reader = threading.Thread(target=lambda: stdout_chunks.append(process.stdout.read() if process.stdout else ""))
        reader.start()
        # The worker enforces the request's timeout_seconds itself; this is the backstop for the call's budget.
        watchdog = threading.Timer(timeout + 30, _kill_group, args=(process.pid, record))
        watchdog.start()
        with Sampler(process.pid, nvml, interval) as sampler:
            assert process.stderr is not None
            for line in process.stderr:
                log.write(line)
                log.flush()
                event = parse_trainer_event(line)
                if event is not None and events.take(event):
                    sampler.phase = events.phase
            record.exit_status = process.wait()
            events.close()
        watchdog.cancel()
        reader.join()
    record.wall_seconds = round(time.monotonic() - started, 1)
    record.host_peak, record.host_by_phase = sampler.host_peak, sampler.host_by_phase
    record.nvml_used_peak, record.nvml_used_by_phase = sampler.nvml_peak, sampler.nvml_by_phase
    record.phase_seconds = events.phase_seconds
    record.seconds_per_step = events.median_step()
    text = "".join(stdout_chunks)
    (folder / "result.json").write_text(text)
    try:
        return json.loads(text)
    except ValueError:
        return {"error": {"code": "no_result", "message": text[-300:]}}


def read_result(result: dict[str, Any], record: RunRecord) -> None:
    """The outcome and the trainer's own measurements (GPU peaks, memory fraction) from the result JSON."""
    if "error" in result:
        error = result["error"]
        if isinstance(error, str):
            # The wire shape (errors.error_for_the_wire) carries the error as one JSON string.
            try:
                error = json.loads(error)
            except ValueError:
                error = {"code": "error", "message": error}
        record.outcome = f"{error.get('code', 'error')}: {str(error.get('message', ''))[:160]}"
        return
    record.outcome = "ok"
    metrics = result.get("metrics", {})
    record.gpu_allocated_peak = metrics.get("peak_gpu_allocated_bytes", metrics.get("peak_gpu_bytes"))
    record.gpu_reserved_peak = metrics.get("peak_gpu_reserved_bytes")
    record.memory_fraction = metrics.get("cuda_memory_fraction")
    if record.gpu_reserved_peak is None and record.gpu_allocated_peak is not None:
        record.notes.append("the trainer reports no reserved peak (metrics.peak_gpu_reserved_bytes)")
