"""Building and launching real trainer jobs for tests: a tiny FLUX base model, a generated dataset,
the launch files written by `fluxbooth.job.launch_files` (exactly what the worker writes), and `accelerate
launch` of `fluxbooth.train` with the environment the worker gives it (DeepSpeed on the CPU)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.events import event_payload, parse_event
from fluxbooth.contract.names import GUIDANCE_DISTILLED_SAMPLING
from fluxbooth.contract.settings_groups import Checkpoints, Export, Memory, Optimisation, Prompts, Sampling
from fluxbooth.contract.trainer_config import LoraSettings, TrainerConfig
from fluxbooth.host.limits import allowed_cpus
from fluxbooth.job.launch import trainer_command
from fluxbooth.job.launch_files import child_environment, write_launch_files
from fluxbooth.job.op_builds import extensions_dir
from fluxbooth.plan import Plan
from fluxbooth.request.spec import model_sampling
from fluxbooth.settings import WorkerSettings
from fluxbooth.sizing import model_size
from tests.support.regroup import regrouped

LAUNCH_TIMEOUT_SECONDS = 600
RESOLUTION = Resolution(fixed=(64, 64))
# Small rank and a few targets keep LoRA runs fast; the exports still cover fused and single layers.
TEST_LORA = LoraSettings(rank=4, alpha=8.0)


def make_images(folder: Path, count: int, *, seed: int = 0, size: tuple[int, int] = (96, 80)) -> list[Path]:
    """`count` distinct RGB images (smooth gradients plus a coloured square), not square, so the
    resize-and-crop path runs."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(seed)
    paths = []
    width, height = size
    for index in range(count):
        y, x = np.mgrid[0:height, 0:width]
        base = generator.uniform(0, 255, size=3)
        image = np.stack(
            [(base[c] + 60 * np.sin((x + 7 * index) / (9 + c)) + 40 * np.cos(y / 11)) for c in range(3)], -1
        )
        left, top = generator.integers(0, width - 24), generator.integers(0, height - 24)
        image[top : top + 24, left : left + 24] = generator.uniform(0, 255, size=3)
        path = folder / f"photo{index}.png"
        Image.fromarray(np.clip(image, 0, 255).astype("uint8")).save(path)
        paths.append(path)
    return paths


def make_plan(
    *,
    zero_stage: int = 2,
    training_type: str = "full",
    offload_optimizer: str = "cpu",
    offload_param: str = "none",
    num_processes: int = 1,
    mixed_precision: str = "bf16",
    use_deepspeed: bool = True,
) -> Plan:
    return Plan(
        accelerator="cpu",
        num_processes=num_processes,
        training_type=training_type,  # type: ignore[arg-type]
        use_deepspeed=use_deepspeed,
        zero_stage=zero_stage,
        offload_optimizer=offload_optimizer,  # type: ignore[arg-type]
        offload_param=offload_param,  # type: ignore[arg-type]
        mixed_precision=mixed_precision,  # type: ignore[arg-type]
        gradient_checkpointing=True,
        optimizer="adamw",
        predicted_gpu_bytes=0,
        predicted_host_bytes=0,
        predicted_disk_bytes=0,
    )


def guidance_scale_of(base_model: Path) -> float:
    """The validation guidance scale the job spec resolves for `base_model` (a folder that is never loaded: dev's)."""
    if not Path(base_model).is_dir():
        return GUIDANCE_DISTILLED_SAMPLING.guidance_scale
    return model_sampling(model_size(str(base_model))).guidance_scale


def make_trainer_config(job_dir: Path, base_model: Path, plan: Plan, **overrides: Any) -> TrainerConfig:
    config = TrainerConfig(
        base_model=str(base_model),
        instance_dir=str(job_dir / "instance"),
        class_dir=None,
        output_dir=str(job_dir / "output"),
        cache_dir=str(job_dir / "cache"),
        resolution=RESOLUTION,
        training_type=plan.training_type,
        prompts=Prompts(
            instance_prompt="a photo of sks dog",
            class_prompt="a photo of a dog",
            with_prior_preservation=False,
            prior_loss_weight=1.0,
            num_class_images=2,
        ),
        optimisation=Optimisation(
            steps=3,
            learning_rate=1e-3 if plan.training_type == "lora" else 1e-4,
            batch_size=1,
            gradient_accumulation_steps=1,
            seed=7,
        ),
        sampling=Sampling(
            max_sequence_length=32,
            validation_inference_steps=2,
            validation_guidance_scale=guidance_scale_of(base_model),
            class_image_inference_steps=2,
        ),
        memory=Memory(
            mixed_precision=plan.mixed_precision,
            checkpoint_every=1,
            zero_stage=plan.zero_stage,
            offload_optimizer=plan.offload_optimizer,
            offload_param=plan.offload_param,
        ),
        lora=TEST_LORA,
        checkpoints=Checkpoints(dir=str(job_dir / "checkpoints")),
        export=Export(formats=("diffusers",)),
    )
    # Tests name settings by their flat names (steps=4, validation_prompts=...): each goes to its group.
    return regrouped(config, **overrides)


@dataclass
class TrainerRun:
    returncode: int
    events: list[dict[str, Any]]
    log: str
    job_dir: Path
    config: TrainerConfig

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)

    @property
    def done(self) -> dict[str, Any]:
        found = [event for event in self.events if event["event"] == "done"]
        assert found, f"no done event (exit {self.returncode}); log tail:\n{self.log[-4000:]}"
        return found[-1]

    @property
    def metrics(self) -> dict[str, Any]:
        return self.done["metrics"]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["event"] == kind]

    def artifact(self, kind: str) -> Path:
        matches = [entry for entry in self.done["artifacts"] if entry["kind"] == kind]
        assert len(matches) == 1, f"expected one {kind} artifact in {self.done['artifacts']}"
        return self.output_dir / matches[0]["path"]


@dataclass
class TrainerJob:
    job_dir: Path
    plan: Plan
    config: TrainerConfig
    extra_env: dict[str, str] = field(default_factory=dict)

    def write(self) -> Any:
        return write_launch_files(self.job_dir, self.plan, self.config)

    def environment(self) -> dict[str, str]:
        torch_extensions = extensions_dir(WorkerSettings.from_environ(os.environ))
        env = child_environment(
            self.plan, os.environ, cpu_count=allowed_cpus(Path("/")), torch_extensions_dir=torch_extensions
        )
        env.update(self.extra_env)
        return env

    def launch(self) -> TrainerRun:
        files = self.write()
        completed = subprocess.run(
            trainer_command(files, self.plan, allowed_cpus(Path("/"))),
            env=self.environment(),
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT_SECONDS,
            start_new_session=True,
        )
        return self._run_from(completed.returncode, completed.stdout, completed.stderr)

    def launch_as_nodes(self, machines: int) -> list[TrainerRun]:
        """One `accelerate launch` per "machine" (one process each), all on localhost, rendezvousing
        through a free port: what a hand-written multi-node accelerate config does across hosts."""
        files = self.write()
        base = yaml.safe_load(files.accelerate_config.read_text())
        port = free_port()
        processes = []
        for rank in range(machines):
            node_config = dict(
                base,
                num_machines=machines,
                machine_rank=rank,
                num_processes=machines,
                main_process_ip="127.0.0.1",
                main_process_port=port,
            )
            # accelerate's default multi-node DeepSpeed launcher is pdsh over ssh; "standard" is torchrun per node.
            node_config["deepspeed_config"] = dict(base["deepspeed_config"], deepspeed_multinode_launcher="standard")
            node_file = files.accelerate_config.with_name(f"accelerate-node{rank}.yaml")
            node_file.write_text(yaml.safe_dump(node_config))
            command = trainer_command(files, self.plan, allowed_cpus(Path("/")))
            command[command.index("--config_file") + 1] = str(node_file)
            processes.append(
                subprocess.Popen(
                    command,
                    env=self.environment(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        runs = []
        for process in processes:
            stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT_SECONDS)
            runs.append(self._run_from(process.returncode, stdout, stderr))
        return runs

    def _run_from(self, returncode: int, stdout: str, stderr: str) -> TrainerRun:
        # The tests read the events as they travel: flat JSON objects.
        events = [event_payload(event) for line in stdout.splitlines() if (event := parse_event(line)) is not None]
        return TrainerRun(returncode, events, stdout + stderr, self.job_dir, self.config)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def new_job(
    job_dir: Path, base_model: Path, *, images: int = 3, plan: Plan | None = None, **overrides: Any
) -> TrainerJob:
    plan = plan or make_plan()
    config = make_trainer_config(job_dir, base_model, plan, **overrides)
    if not Path(config.instance_dir).exists():
        make_images(Path(config.instance_dir), images)
    return TrainerJob(job_dir=job_dir, plan=plan, config=config)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


# --- reading what a run produced ---------------------------------------------------------------

PROMPT = "a photo of sks dog"
LORA_FORMATS = ("diffusers", "comfyui")


def assert_succeeded(run: TrainerRun) -> None:
    assert run.returncode == 0, run.log[-6000:]


def load_pipeline(base: Path, **overrides: Any) -> Any:
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(base, **overrides)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def render(pipeline: Any) -> Any:
    """PROMPT at 64x64 in two steps, seed 0, as a numpy image."""
    import torch

    return pipeline(
        PROMPT, height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np"
    ).images[0]


def base_image(base: Path, **pipeline_overrides: Any) -> Any:
    return render(load_pipeline(base, **pipeline_overrides))


def transformer_state(folder: Path) -> dict[str, Any]:
    """Every tensor of a saved diffusers transformer, as float32."""
    from diffusers import FluxTransformer2DModel

    return {
        name: tensor.float() for name, tensor in FluxTransformer2DModel.from_pretrained(folder).state_dict().items()
    }


def lora_pipeline(base: Path, lora_file: Path) -> Any:
    pipeline = load_pipeline(base)
    pipeline.load_lora_weights(lora_file.parent, weight_name=lora_file.name)
    return pipeline


def assert_refused(run: TrainerRun, code: str, *fragments: str) -> None:
    """The trainer stopped before its first step with one `error` event of `code` naming each fragment."""
    assert run.returncode != 0
    (error,) = run.of_kind("error")
    assert error["code"] == code, error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    assert not run.of_kind("step")
