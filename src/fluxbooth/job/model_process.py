"""A model process of the job besides the trainer (the captioner, the scorer): the environment it finds its models
through, and one run under the supervisor for at most the seconds the deadline leaves it, with why it left no
output when it did not finish."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from fluxbooth.job.launch_files import INHERITED_ENV_NAMES
from fluxbooth.job.supervisor import supervise
from fluxbooth.redaction import Redactor
from fluxbooth.settings import SECRET_ENV_NAMES

# Where the models may be found (Hugging Face's caches, the worker's folders and overrides): passed to the process
# in its environment, never written into its input file (the same environment holds HF_TOKEN).
MODEL_LOCATION_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "FLUXBOOTH_")
MODEL_LOCATION_NAMES = frozenset({"HOME", "XDG_CACHE_HOME", "TORCH_HOME"})


def model_location_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The worker's variables that say where models are (Hugging Face's caches, the worker's folders), no secret."""
    return {
        name: value
        for name, value in environ.items()
        if (name in MODEL_LOCATION_NAMES or name.startswith(MODEL_LOCATION_PREFIXES)) and name not in SECRET_ENV_NAMES
    }


def model_process_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """A model process's whole environment, which it reads the model locations from (its input carries none): the
    trainer's allow-list (HF_TOKEN included, for a download) and the model locations."""
    inherited = {name: value for name, value in environ.items() if name in INHERITED_ENV_NAMES}
    return {
        **inherited,
        **model_location_environment(environ),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


async def run_model_process(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    seconds: float,
    redact: Redactor,
    log_path: Path,
    kill_grace_seconds: float,
    name: str,
    timed_out: str,
) -> str | None:
    """Run `command` for at most `seconds`: None when it exited cleanly, else why its output is missing or partial:
    `timed_out`, or that `name` failed, with its exit status and its log's last line."""
    outcome = await supervise(
        command,
        env=env,
        cwd=cwd,
        deadline_seconds=seconds,
        redact=redact,
        on_event=lambda _event: None,
        log_path=log_path,
        kill_grace_seconds=kill_grace_seconds,
    )
    if outcome.timed_out:
        return timed_out
    if outcome.returncode != 0:
        last = next((line.strip() for line in reversed(outcome.log_tail) if line.strip()), "no output")
        return f"{name} failed (exit status {outcome.returncode}): {last[:300]}"
    return None
