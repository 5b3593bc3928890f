"""fluxbooth's end-to-end time against a minimal diffusers-style LoRA loop on the same job.

The job: the 70 M-parameter "scaled" FLUX transformer (`python -m fluxbooth.synthetic --preset scaled`,
with the tiny encoders and VAE), four images, LoRA rank 16, 256², batch 1, 8 steps, in fp32: a CPU
without AVX-512 (this one) emulates bf16 arithmetic, which would make both sides several times slower.

- fluxbooth: `python -m fluxbooth train request.json`, timed from process start to exit: request
  checks, plan, dataset preparation, `accelerate launch` of the DeepSpeed trainer, export, local store.
- reference: `python bench/trainer_overhead.py reference ...`, this file's own loop, written the way
  diffusers' `train_dreambooth_lora_flux.py` does it in one process: load the pipeline's parts, encode
  the prompt, VAE-encode the images, add a peft LoRA, 8 flow-matching steps with AdamW, save the LoRA.

Runs alternate (reference, fluxbooth, ...) so load from other processes hits both alike; medians. Besides
wall-clock seconds, each run's CPU seconds (user + system, summed over its whole process tree) are
recorded: on a shared machine they move far less with the load than wall time does.
`python bench/trainer_overhead.py [--repeats N]` prints the table and rewrites its section of
bench/RESULTS.md. Each fluxbooth run's stage timeline (seconds since start, from the progress lines
on stderr) is printed too: it is where the fixed overhead goes.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluxbooth.job.op_builds import extensions_dir
from fluxbooth.settings import WorkerSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "bench" / "RESULTS.md"
sys.path.insert(0, str(REPO_ROOT / "bench"))

STEPS = 8
RANK = 16
SIDE = 256
IMAGES = 4
LEARNING_RATE = 1e-4
PROMPT = "a photo of sks toy"
SEED = 42
# The attention projections (what diffusers' FLUX LoRA script trains unless told otherwise); fluxbooth's
# default also trains the feed-forward and single-block projections, so the request names these.
LORA_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
PROGRESS_LINE = re.compile(r"^\[(\d+):(\d\d)\] (\S+)(.*)$")


@dataclass
class Run:
    seconds: float
    cpu_seconds: float
    step_seconds: list[float]
    timeline: list[tuple[float, str]]


def timed(command: list[str], **options: Any) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """Run `command`; its wall seconds and the CPU seconds of its whole (reaped) process tree."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, check=False, **options)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return completed, seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def noisy_jpegs(count: int, side: int) -> list[bytes]:
    """Photo-like JPEGs (noise over a gradient), larger than the training resolution."""
    import numpy
    from PIL import Image

    generator = numpy.random.default_rng(0)
    images = []
    for index in range(count):
        gradient = numpy.linspace(0, 255, side, dtype=numpy.float32)[None, :, None]
        pixels = (0.5 * gradient + 0.5 * generator.integers(0, 255, (side, side, 3))).astype(numpy.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).rotate(index * 90).save(buffer, format="JPEG", quality=90)
        images.append(buffer.getvalue())
    return images


def scaled_model(cache: Path) -> Path:
    """The scaled preset, built once per cache folder (the builder reuses a complete folder)."""
    target = cache / "scaled-flux"
    subprocess.run(
        [sys.executable, "-m", "fluxbooth.synthetic", "--preset", "scaled", str(target)],
        check=True,
        capture_output=True,
        cwd=REPO_ROOT,
    )
    return target


def fluxbooth_request(model: Path, images: list[bytes]) -> dict[str, Any]:
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as writer:
        for index, image in enumerate(images):
            writer.writestr(f"photo{index}.jpg", image)
    return {
        "model_name": "bench-overhead",
        "base_model": str(model),
        "dataset": base64.b64encode(archive.getvalue()).decode(),
        "instance_prompt": PROMPT,
        "steps": STEPS,
        "learning_rate": LEARNING_RATE,
        "resolution": f"{SIDE}x{SIDE}",
        "training_type": "lora",
        "lora_rank": RANK,
        "batch_size": 1,
        "mixed_precision": "no",
        "seed": SEED,
        # What the reference writes: the diffusers LoRA file (fluxbooth's LoRA default adds a ComfyUI one).
        "output_formats": ["diffusers"],
        "lora_target_modules": LORA_TARGETS,
    }


def timeline_from(stderr: str) -> list[tuple[float, str]]:
    """(seconds since the job began, what started) from the progress lines, each stage once."""
    timeline: list[tuple[float, str]] = []
    for line in stderr.splitlines():
        match = PROGRESS_LINE.match(line.strip("\r"))
        if match and (not timeline or timeline[-1][1] != match.group(3)):
            timeline.append((int(match.group(1)) * 60 + int(match.group(2)), match.group(3)))
    return timeline


def step_seconds_from(stderr: str) -> list[float]:
    """Each step's seconds, from the trainer's step events in the worker's log (`--verbose`)."""
    marker = "trainer event | "
    events = [json.loads(line.split(marker, 1)[1]) for line in stderr.splitlines() if marker in line]
    return [event["seconds_per_step"] for event in events if event.get("event") == "step"]


def run_fluxbooth(work: Path, model: Path, images: list[bytes], index: int) -> Run:
    request = work / f"request-{index}.json"
    request.write_text(json.dumps(fluxbooth_request(model, images)))
    # The worker's caches persist between jobs, DeepSpeed's compiled ops above all (a first job builds
    # CPU Adam: minutes); a worker's steady state is what is compared.
    env = {
        **os.environ,
        "FLUXBOOTH_WORK_DIR": str(work / "jobs"),
        "FLUXBOOTH_OUTPUT_DIR": str(work / "outputs"),
        "FLUXBOOTH_CACHE_DIR": str(model.parent / "worker-cache"),
        "HF_HUB_OFFLINE": "1",
        # The ops folder the worker and the tests build into, so the bench reuses the build.
        "TORCH_EXTENSIONS_DIR": str(extensions_dir(WorkerSettings.from_environ(os.environ))),
    }
    completed, seconds, cpu_seconds = timed(
        [sys.executable, "-m", "fluxbooth", "train", str(request), "--job-id", f"bench-{index}", "--verbose"],
        env=env,
        cwd=work,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"fluxbooth failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    (work / f"fluxbooth-{index}.log").write_text(completed.stderr)
    return Run(seconds, cpu_seconds, step_seconds_from(completed.stderr), timeline_from(completed.stderr))


def run_reference(work: Path, model: Path, images: list[bytes], index: int) -> Run:
    image_dir = work / "reference-images"
    image_dir.mkdir(exist_ok=True)
    for number, image in enumerate(images):
        (image_dir / f"photo{number}.jpg").write_bytes(image)
    report = work / f"reference-{index}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count()), "TMPDIR": str(work)}
    completed, seconds, cpu_seconds = timed(
        [sys.executable, __file__, "reference", str(model), str(image_dir), str(work / f"lora-{index}"), str(report)],
        env=env,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"the reference loop failed:\n{completed.stderr[-3000:]}")
    return Run(seconds, cpu_seconds, json.loads(report.read_text())["step_seconds"], [])


def section(references: list[Run], ours: list[Run], load: tuple[float, float]) -> str:
    reference_total = statistics.median(run.seconds for run in references)
    ours_total = statistics.median(run.seconds for run in ours)
    reference_cpu = statistics.median(run.cpu_seconds for run in references)
    ours_cpu = statistics.median(run.cpu_seconds for run in ours)
    # Step 1 includes one-off work (allocations, the optimizer's first state); later steps are the steady state.
    reference_step = statistics.median(second for run in references for second in run.step_seconds[1:])
    ours_step = statistics.median(second for run in ours for second in run.step_seconds[1:])
    timeline = ", ".join(f"{stage} {seconds:.0f}" for seconds, stage in ours[len(ours) // 2].timeline)
    return "\n".join(
        [
            "## Trainer overhead vs a plain diffusers-style loop (`bench/trainer_overhead.py`)",
            "",
            f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}; load average {load[0]:.1f} before, {load[1]:.1f} after (shared machine). "
            f"Job: scaled FLUX transformer (70 M), {IMAGES} images, LoRA rank {RANK}, {SIDE}², {STEPS} steps, fp32; "
            f"median of {len(ours)} alternating runs each.",
            "",
            "| | fluxbooth | reference loop | ratio |",
            "|---|---:|---:|---:|",
            f"| end to end, wall (s) | {ours_total:.1f} | {reference_total:.1f} | {ours_total / reference_total:.2f}× |",
            f"| end to end, CPU (s) | {ours_cpu:.1f} | {reference_cpu:.1f} | {ours_cpu / reference_cpu:.2f}× |",
            f"| per step, wall (s) | {ours_step:.2f} | {reference_step:.2f} | {ours_step / reference_step:.2f}× |",
            "",
            f"fluxbooth's timeline (s since start, stage begins): {timeline}.",
        ]
    )


def write_section(text: str, name: str = "trainer-overhead") -> None:
    from overhead import write_section as write_named_section

    write_named_section(text, name)


def compare(repeats: int, write: bool) -> None:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="trainer-overhead-") as scratch:
        work = Path(scratch)
        model = scaled_model(
            Path(os.environ.get("FLUXBOOTH_BENCH_CACHE") or Path.home() / ".cache" / "fluxbooth" / "bench")
        )
        images = noisy_jpegs(IMAGES, SIDE + 64)
        references, ours = [], []
        for index in range(repeats):
            references.append(run_reference(work, model, images, index))
            ours.append(run_fluxbooth(work, model, images, index))
            print(
                f"run {index}: reference {references[-1].seconds:.1f} s ({references[-1].cpu_seconds:.0f} CPU s, steps "
                f"{references[-1].step_seconds}), fluxbooth {ours[-1].seconds:.1f} s ({ours[-1].cpu_seconds:.0f} CPU s, "
                f"steps {ours[-1].step_seconds}, timeline {ours[-1].timeline})",
                flush=True,
            )
    text = section(references, ours, (load_before, os.getloadavg()[0]))
    print(text)
    if write:
        write_section(text)


# --- the reference loop (runs in its own process; the only place this file imports torch) ----------


def load_latents(model: Path, image_dir: Path) -> tuple[list[Any], int]:
    """Each image resized and centre-cropped to SIDE², VAE-encoded and normalised, as diffusers' script does;
    and the VAE's scale factor (for unpacking predictions)."""
    import numpy
    import torch
    from diffusers import AutoencoderKL
    from PIL import Image

    vae = AutoencoderKL.from_pretrained(model, subfolder="vae", torch_dtype=torch.float32)
    latents = []
    for path in sorted(image_dir.iterdir()):
        with Image.open(path) as opened:
            image = opened.convert("RGB")
        scale = SIDE / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BILINEAR)
        left, top = (image.width - SIDE) // 2, (image.height - SIDE) // 2
        pixels = numpy.asarray(image.crop((left, top, left + SIDE, top + SIDE)), dtype=numpy.float32) / 127.5 - 1.0
        tensor = torch.from_numpy(pixels).permute(2, 0, 1)[None]
        with torch.no_grad():
            sample = vae.encode(tensor).latent_dist.sample()
        latents.append(((sample - vae.config.shift_factor) * vae.config.scaling_factor).float())
    return latents, 2 ** (len(vae.config.block_out_channels) - 1)


def train(model: Path, image_dir: Path, output: Path, report: Path) -> None:
    """Encode, VAE-encode, LoRA, STEPS flow-matching steps, save: the whole job, in one process."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(SEED)
    dtype = torch.float32
    text_pipeline = FluxPipeline.from_pretrained(model, transformer=None, vae=None, torch_dtype=dtype)
    with torch.no_grad():
        prompt_embeds, pooled_embeds, text_ids = text_pipeline.encode_prompt(
            PROMPT, prompt_2=None, max_sequence_length=512
        )
    del text_pipeline
    latents, vae_scale_factor = load_latents(model, image_dir)

    transformer = FluxTransformer2DModel.from_pretrained(model, subfolder="transformer", torch_dtype=dtype)
    transformer.requires_grad_(False)
    transformer.enable_gradient_checkpointing()
    transformer.add_adapter(
        LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights="gaussian", target_modules=LORA_TARGETS)
    )
    trainable = [parameter for parameter in transformer.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(model, subfolder="scheduler")
    guidance = torch.ones(1) if transformer.config.guidance_embeds else None

    step_seconds, loss = [], torch.zeros(())
    for step in range(STEPS):
        started = time.perf_counter()
        x0 = latents[step % len(latents)]
        batch, channels, height, width = x0.shape
        noise = torch.randn_like(x0)
        u = compute_density_for_timestep_sampling(
            weighting_scheme="none", batch_size=batch, logit_mean=0.0, logit_std=1.0, mode_scale=1.29
        )
        indices = (u * scheduler.config.num_train_timesteps).long()
        sigma = scheduler.sigmas[indices].view(batch, 1, 1, 1)
        packed = FluxPipeline._pack_latents((1.0 - sigma) * x0 + sigma * noise, batch, channels, height, width)
        img_ids = FluxPipeline._prepare_latent_image_ids(batch, height // 2, width // 2, x0.device, dtype)
        with torch.autocast("cpu", enabled=False):
            prediction = transformer(
                hidden_states=packed.to(dtype),
                timestep=(scheduler.timesteps[indices] / 1000).to(dtype),
                guidance=guidance,
                pooled_projections=pooled_embeds,
                encoder_hidden_states=prompt_embeds,
                txt_ids=text_ids,
                img_ids=img_ids,
                return_dict=False,
            )[0]
        prediction = FluxPipeline._unpack_latents(
            prediction, height * vae_scale_factor, width * vae_scale_factor, vae_scale_factor
        )
        loss = ((prediction.float() - (noise - x0)) ** 2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step_seconds.append(time.perf_counter() - started)

    FluxPipeline.save_lora_weights(output, transformer_lora_layers=get_peft_model_state_dict(transformer))
    report.write_text(json.dumps({"step_seconds": step_seconds, "final_loss": float(loss)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")
    reference = commands.add_parser("reference", help="run the reference loop once (what the comparison times)")
    for name in ("model", "images", "output", "report"):
        reference.add_argument(name, type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/RESULTS.md alone")
    arguments = parser.parse_args()
    if arguments.command == "reference":
        train(arguments.model, arguments.images, arguments.output, arguments.report)
        return
    compare(arguments.repeats, not arguments.no_write)


if __name__ == "__main__":
    main()
