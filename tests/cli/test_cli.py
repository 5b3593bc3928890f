"""`python -m fluxbooth plan` and `doctor` (**contract**): flags, JSON fields, exit codes."""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fluxbooth.cli import main
from fluxbooth.cli.exits import EXIT_CLOSED_PIPE, EXIT_FAILED, EXIT_OK, EXIT_USAGE
from fluxbooth.host.container_limits import limit_bytes
from fluxbooth.host.hardware import GIB
from fluxbooth.request.limits import MAX_TIMEOUT_SECONDS
from fluxbooth.settings import WorkerSettings

CANDIDATE_FIELDS = {
    "zero_stage",
    "offload_optimizer",
    "offload_param",
    "training_type",
    "fits",
    "gpu_bytes",
    "host_bytes",
    "disk_bytes",
    "reason",
}
EIGHT_GIB_CARD = ["--gpu-memory", "8GiB", "--host-memory", "48GiB", "--gpus", "1", "--cpus", "16", "--disk", "200GiB"]
EIGHTY_GIB_CARD = [
    "--gpu-memory",
    "80GiB",
    "--host-memory",
    "256GiB",
    "--gpus",
    "1",
    "--cpus",
    "16",
    "--disk",
    "200GiB",
]
# Tests about memory, not time: the longest deadline a request may ask for, so the time check stays out of the way.
LONGEST_DEADLINE = ["--deadline", str(MAX_TIMEOUT_SECONDS)]
CPU_ONLY_MACHINE = ["--gpus", "0", "--host-memory", "24GiB", "--cpus", "2", "--disk", "100GiB"]
FLUX_DEV_FULL_1024 = [
    "--base-model",
    "black-forest-labs/FLUX.1-dev",
    "--training-type",
    "full",
    "--resolution",
    "1024x1024",
]
NO_GPU_HERE = pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")


def run_cli(arguments: list[str], environ: dict[str, str]) -> tuple[int, str]:
    out = io.StringIO()
    code = main(arguments, environ, out)
    return code, out.getvalue()


@pytest.fixture
def cli_env(tmp_path: Path, torch_extensions_dir: Path) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "FLUXBOOTH_WORK_DIR": str(tmp_path / "work"),
        "FLUXBOOTH_OUTPUT_DIR": str(tmp_path / "outputs"),
        "FLUXBOOTH_CACHE_DIR": str(tmp_path / "cache"),
        "FLUXBOOTH_VOLUME_DIR": str(tmp_path / "no-volume"),
        "TORCH_EXTENSIONS_DIR": str(torch_extensions_dir),
        "HF_HUB_OFFLINE": "1",
    }


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fluxbooth.synthetic.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "tiny-flux")


# ---- plan: issue 5 "done when" ---------------------------------------------------------------------


def test_plan_json_chooses_nothing_for_full_flux_dev_on_8_gib_and_48_gib_host(cli_env: dict[str, str]) -> None:
    code, output = run_cli(["plan", *EIGHT_GIB_CARD, *FLUX_DEV_FULL_1024, "--json"], cli_env)
    report = json.loads(output)
    assert code == EXIT_FAILED
    assert report["chosen"] is None
    assert "host RAM" in report["error"]["message"]
    requested = [candidate for candidate in report["candidates"] if candidate["training_type"] == "full"]
    assert requested and not any(candidate["fits"] for candidate in requested)
    # The best full strategy for an 8 GiB card is refused for host RAM, not for the GPU.
    zero3_offload = next(c for c in requested if c["zero_stage"] == 3 and c["offload_param"] == "cpu")
    assert "host RAM" in zero3_offload["reason"] and zero3_offload["host_bytes"] > 48 * GIB
    assert any(candidate["training_type"] == "lora" and candidate["fits"] for candidate in report["candidates"])


def test_plan_json_chooses_a_plan_on_80_gib_and_256_gib_host(cli_env: dict[str, str]) -> None:
    code, output = run_cli(["plan", *EIGHTY_GIB_CARD, *FLUX_DEV_FULL_1024, *LONGEST_DEADLINE, "--json"], cli_env)
    report = json.loads(output)
    assert code == EXIT_OK
    assert report["chosen"]["training_type"] == "full"
    assert report["chosen"]["fits"] is True
    assert report["plan"]["zero_stage"] == report["chosen"]["zero_stage"]


def test_every_candidate_carries_the_contract_fields(cli_env: dict[str, str]) -> None:
    _, output = run_cli(["plan", *EIGHT_GIB_CARD, *FLUX_DEV_FULL_1024, "--json"], cli_env)
    for candidate in json.loads(output)["candidates"]:
        assert CANDIDATE_FIELDS <= set(candidate)


def test_zero2_cpu_offload_candidate_predicts_at_least_the_bf16_weights(cli_env: dict[str, str]) -> None:
    _, output = run_cli(["plan", *EIGHTY_GIB_CARD, *FLUX_DEV_FULL_1024, "--json"], cli_env)
    zero2_offload = next(
        c
        for c in json.loads(output)["candidates"]
        if (c["training_type"], c["zero_stage"], c["offload_optimizer"]) == ("full", 2, "cpu")
    )
    assert zero2_offload["gpu_bytes"] >= 22 * GIB


def test_plan_table_lists_candidates_and_the_choice(cli_env: dict[str, str]) -> None:
    code, output = run_cli(
        ["plan", *EIGHTY_GIB_CARD, *FLUX_DEV_FULL_1024, "--gpu-name", "H100", *LONGEST_DEADLINE], cli_env
    )
    assert code == EXIT_OK
    assert "offload opt/param" in output
    # 256 GiB of host RAM would hold ZeRO-2's offloaded AdamW (231 GiB); the fused Adafactor pass is faster.
    assert "chosen: full with Adafactor fused into the backward pass (bf16 weights), no DeepSpeed" in output
    assert "s/step" in output


def test_plan_table_explains_a_refusal(cli_env: dict[str, str]) -> None:
    code, output = run_cli(["plan", *EIGHT_GIB_CARD, *FLUX_DEV_FULL_1024], cli_env)
    assert code == EXIT_FAILED
    assert "\nrefused (does_not_fit): " in output and "Would fit: LoRA rank 16" in output


def test_lora_rank_flag_changes_the_trainable_parameters(cli_env: dict[str, str]) -> None:
    def trainable(rank: str) -> int:
        _, output = run_cli(
            [
                "plan",
                *EIGHTY_GIB_CARD,
                "--base-model",
                "black-forest-labs/FLUX.1-dev",
                "--training-type",
                "lora",
                "--lora-rank",
                rank,
                *LONGEST_DEADLINE,
                "--json",
            ],
            cli_env,
        )
        return json.loads(output)["chosen"]["breakdown"]["trainable_params"]

    assert trainable("32") == 2 * trainable("16")


def test_a_deadline_too_short_for_the_steps_is_refused(cli_env: dict[str, str]) -> None:
    code, output = run_cli(
        ["plan", *EIGHTY_GIB_CARD, *FLUX_DEV_FULL_1024, "--steps", "5000", "--deadline", "600", "--json"], cli_env
    )
    assert code == EXIT_FAILED
    assert "beyond the job deadline" in json.loads(output)["error"]["message"]


def test_a_local_model_on_a_cpu_only_machine_gets_the_guides_strategy(
    cli_env: dict[str, str], tiny_model_dir: Path
) -> None:
    code, output = run_cli(
        [
            "plan",
            "--base-model",
            str(tiny_model_dir),
            "--resolution",
            "64",
            *CPU_ONLY_MACHINE,
            *LONGEST_DEADLINE,
            "--json",
        ],
        cli_env,
    )
    report = json.loads(output)
    assert code == EXIT_OK
    assert report["plan"]["accelerator"] == "cpu"
    assert (report["plan"]["zero_stage"], report["plan"]["offload_optimizer"]) == (2, "cpu")


def test_a_request_file_supplies_the_job(cli_env: dict[str, str], tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text(
        json.dumps(
            {
                "input": {
                    "model_name": "m",
                    "dataset": "UEsFBgAAAAAAAAAAAAAAAAAAAAAAAA==",
                    "instance_prompt": "a sks dog",
                    "base_model": "black-forest-labs/FLUX.1-dev",
                    "training_type": "lora",
                    "lora_rank": 8,
                    "resolution": "512x512",
                }
            }
        )
    )
    code, output = run_cli(["plan", *EIGHT_GIB_CARD, "--request", str(request), *LONGEST_DEADLINE, "--json"], cli_env)
    report = json.loads(output)
    assert code == EXIT_OK
    assert report["job"]["resolution"] == [512, 512]
    assert report["chosen"]["lora_rank"] == 8


def test_an_unknown_model_is_invalid_input_with_exit_2(cli_env: dict[str, str]) -> None:
    code, output = run_cli(["plan", *EIGHT_GIB_CARD, "--base-model", "someone/model", "--json"], cli_env)
    assert code == EXIT_USAGE
    assert json.loads(output)["error"]["code"] == "invalid_input"


def test_a_malformed_size_is_a_usage_error(cli_env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["plan", "--gpu-memory", "lots"], cli_env, io.StringIO())
    assert caught.value.code == EXIT_USAGE
    assert "'lots' is not a size" in capsys.readouterr().err


def test_python_dash_m_fluxbooth_plan_is_the_entry_point(cli_env: dict[str, str]) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth", "plan", *EIGHT_GIB_CARD, *FLUX_DEV_FULL_1024, "--json"],
        capture_output=True,
        text=True,
        env=cli_env,
        timeout=120,
        check=False,
    )
    assert completed.returncode == EXIT_FAILED
    assert json.loads(completed.stdout)["chosen"] is None


# ---- doctor ----------------------------------------------------------------------------------------


def checks_by_name(output: str) -> dict[str, dict[str, str]]:
    return {check["name"]: check for check in json.loads(output)["checks"]}


@NO_GPU_HERE
def test_doctor_on_a_cpu_machine_fails_only_for_cuda(cli_env: dict[str, str]) -> None:
    cli_env["FLUXBOOTH_BASE_MODEL"] = "fluxbooth/tiny-flux"
    code, output = run_cli(["doctor", "--json"], cli_env)
    checks = checks_by_name(output)
    assert code == EXIT_FAILED
    assert checks["CUDA"]["status"] == "fail"
    assert [name for name, check in checks.items() if check["status"] == "fail"] == ["CUDA"]
    assert checks["DeepSpeed"]["status"] == "ok" and "accelerator 'cpu'" in checks["DeepSpeed"]["detail"]
    assert checks["op cpu_adam"]["status"] == "ok"
    assert checks["accelerate"]["status"] == "ok"
    assert checks["config files"]["status"] == "ok"
    assert checks["environment"]["status"] == "ok"
    assert {"host RAM", "disk", "base model", "object storage"} <= set(checks)


@NO_GPU_HERE
def test_doctor_with_allow_cpu_passes_on_a_cpu_machine(cli_env: dict[str, str]) -> None:
    cli_env["FLUXBOOTH_BASE_MODEL"] = "fluxbooth/tiny-flux"
    code, output = run_cli(["doctor", "--allow-cpu"], cli_env)
    assert code == EXIT_OK
    assert "SKIP  CUDA" in output
    assert "all checks passed" in output


def test_doctor_json_reports_the_locked_memory_limit_and_dev_shm(cli_env: dict[str, str]) -> None:
    cli_env["FLUXBOOTH_BASE_MODEL"] = "fluxbooth/tiny-flux"
    _, output = run_cli(["doctor", "--allow-cpu", "--json"], cli_env)
    checks = checks_by_name(output)
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    shm = os.statvfs("/dev/shm")
    locked, shared = checks["locked memory"]["values"], checks["/dev/shm"]["values"]
    assert (locked["memlock_soft_bytes"], locked["memlock_hard_bytes"]) == (limit_bytes(soft), limit_bytes(hard))
    assert shared["shm_total_bytes"] == shm.f_blocks * shm.f_frsize
    assert isinstance(shared["shm_free_bytes"], int)


def test_doctor_fails_when_the_base_model_is_not_on_the_machine(cli_env: dict[str, str], tmp_path: Path) -> None:
    cli_env["FLUXBOOTH_BASE_MODEL"] = str(tmp_path / "models" / "flux")
    code, output = run_cli(["doctor", "--allow-cpu", "--json"], cli_env)
    check = checks_by_name(output)["base model"]
    assert code == EXIT_FAILED
    assert check["status"] == "fail"
    assert "is not on this machine" in check["detail"]


def test_doctor_finds_a_local_base_model_folder(cli_env: dict[str, str], tiny_model_dir: Path) -> None:
    from fluxbooth.job.doctor import check_base_model
    from fluxbooth.settings import WorkerSettings

    result = check_base_model(WorkerSettings.from_environ({**cli_env, "FLUXBOOTH_BASE_MODEL": str(tiny_model_dir)}))
    assert result.status == "ok"
    assert "transformer weights" in result.detail


def test_doctor_heads_the_bucket_without_printing_secrets(
    cli_env: dict[str, str], s3_bucket_env: dict[str, str]
) -> None:
    from fluxbooth.job.doctor import check_bucket
    from fluxbooth.settings import WorkerSettings

    result = check_bucket(WorkerSettings.from_environ({**cli_env, **s3_bucket_env}))
    assert result.status == "ok"
    assert s3_bucket_env["BUCKET_NAME"] in result.detail


def test_doctor_reports_a_missing_bucket_without_printing_secrets(
    cli_env: dict[str, str], s3_bucket_env: dict[str, str]
) -> None:
    from fluxbooth.job.doctor import check_bucket
    from fluxbooth.settings import WorkerSettings

    env = {**cli_env, **s3_bucket_env, "BUCKET_NAME": "no-such-bucket-fluxbooth"}
    result = check_bucket(WorkerSettings.from_environ(env))
    assert result.status == "fail"
    assert "404" in result.detail
    assert s3_bucket_env["BUCKET_SECRET_ACCESS_KEY"] not in result.detail
    assert s3_bucket_env["BUCKET_ACCESS_KEY_ID"] not in result.detail


def test_doctor_reports_a_runtime_probe_that_cannot_import_torch(cli_env: dict[str, str]) -> None:
    from fluxbooth.job.doctor import DoctorOptions, doctor_passed, run_doctor

    def broken_probe(*_: object, **__: object) -> dict[str, str]:
        # A torch install broken beyond import cannot be produced on demand: stand in for its report.
        return {"torch_error": "ImportError: libcudart.so.12: cannot open shared object file"}

    results = run_doctor(
        {**cli_env, "FLUXBOOTH_BASE_MODEL": "fluxbooth/tiny-flux"}, DoctorOptions(allow_cpu=True), probe=broken_probe
    )
    deepspeed = next(result for result in results if result.name == "DeepSpeed")
    assert not doctor_passed(results)
    assert deepspeed.status == "fail"
    assert "libcudart" in deepspeed.detail


# ---- plan --request: defaults that train on RunPod's tiers (issue 9, item 3) ---------------------------

# RunPod's single-GPU tiers: card, memory, host RAM.
RUNPOD_TIERS = {
    "24 GiB RTX 4090": ["--gpu-name", "NVIDIA GeForce RTX 4090", "--gpu-memory", "24GiB", "--host-memory", "62GiB"],
    "48 GiB RTX A6000": ["--gpu-name", "NVIDIA RTX A6000", "--gpu-memory", "48GiB", "--host-memory", "94GiB"],
    "80 GiB H100": ["--gpu-name", "NVIDIA H100 80GB HBM3", "--gpu-memory", "80GiB", "--host-memory", "188GiB"],
}
FLUX_DEV = ["--base-model", "black-forest-labs/FLUX.1-dev", "--gpus", "1", "--cpus", "16", "--disk", "200GiB"]
LORA_RATE_WARNING = (
    "learning_rate 2e-06 is low for a LoRA (suitable: 1e-05 to 0.001); it is used as given — remove "
    "learning_rate to get the default 0.0001"
)


def guide_request(tmp_path: Path, advanced: bool) -> Path:
    """The reference guide's Basic or Advanced request, as written (an empty zip stands in for the photos)."""
    fields: dict[str, object] = {
        "model_name": "my_dreambooth_model",
        "dataset": "UEsFBgAAAAAAAAAAAAAAAAAAAAAAAA==",
        "instance_prompt": "a photo of sks person",
        "class_prompt": "a photo of a person",
        "steps": 2000,
        "learning_rate": 2e-6,
        "batch_size": 1,
        "use_deepspeed": True,
    }
    if advanced:
        fields.update(
            gradient_accumulation_steps=2,
            resolution="1024x1024",
            with_prior_preservation=True,
            prior_loss_weight=1.0,
            num_class_images=50,
            mixed_precision="fp16",
            gradient_checkpointing=True,
        )
    path = tmp_path / ("advanced.json" if advanced else "basic.json")
    path.write_text(json.dumps(fields))
    return path


def plan_json(arguments: list[str], environ: dict[str, str]) -> tuple[int, dict]:
    code, output = run_cli(["plan", *arguments, "--json"], environ)
    return code, json.loads(output)


# The 4090 streams a bf16 base's blocks from host RAM: faster than an fp8 base's dequantisation (test_plan_quantised).
@pytest.mark.parametrize(
    ("tier", "base"), [("24 GiB RTX 4090", "bf16"), ("48 GiB RTX A6000", "bf16"), ("80 GiB H100", "bf16")]
)
def test_a_request_without_training_type_gets_a_lora_plan_on_every_runpod_tier(
    cli_env: dict[str, str], tmp_path: Path, tier: str, base: str
) -> None:
    request = tmp_path / "request.json"
    request.write_text(
        json.dumps(
            {
                "model_name": "m",
                "dataset": "UEsFBgAAAAAAAAAAAAAAAAAAAAAAAA==",
                "instance_prompt": "a photo of sks person",
            }
        )
    )
    code, report = plan_json(["--request", str(request), *FLUX_DEV, *RUNPOD_TIERS[tier], *LONGEST_DEADLINE], cli_env)
    assert code == EXIT_OK
    plan = report["plan"]
    assert (plan["training_type"], plan["base_precision"], plan["offload_param"]) == ("lora", base, "none")
    assert (report["job"]["steps"], report["job"]["resolution"]) == (1000, [1024, 1024])
    assert report["warnings"] == []
    assert list(plan["phases"]) == [
        "download",
        "captioning",
        "loading",
        "caching",
        "class_images",
        "training",
        "validation",
        "export",
        "scoring",
        "report",
        "upload",
    ]
    assert set(plan["phases"]["training"]) == {"gpu_bytes", "host_bytes", "seconds"}


@pytest.mark.parametrize("tier", list(RUNPOD_TIERS))
@pytest.mark.parametrize("advanced", [False, True], ids=["basic", "advanced"])
def test_the_guides_requests_plan_on_every_tier_with_a_warning_about_their_rate(
    cli_env: dict[str, str], tmp_path: Path, tier: str, advanced: bool
) -> None:
    code, report = plan_json(
        ["--request", str(guide_request(tmp_path, advanced)), *FLUX_DEV, *RUNPOD_TIERS[tier], *LONGEST_DEADLINE],
        cli_env,
    )
    assert code == EXIT_OK
    assert report["plan"]["training_type"] == "lora"
    assert LORA_RATE_WARNING in report["warnings"]


def test_at_the_workers_default_deadline_the_guides_basic_request_is_refused_with_the_changes_that_fit(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    code, report = plan_json(
        ["--request", str(guide_request(tmp_path, False)), *FLUX_DEV, *RUNPOD_TIERS["24 GiB RTX 4090"], "--cached"],
        cli_env,
    )
    assert code == EXIT_FAILED
    assert report["error"]["code"] == "does_not_fit"
    # The three default validation prompts, rendered by the base model and at the end, take their share.
    assert report["error"]["message"].endswith(
        "beyond the job deadline of 9 min; use about 59 steps, or fewer validation_prompts (3 now; [] renders none), "
        "or timeout_seconds 7980 (and an endpoint execution timeout above it), or a faster GPU"
    )


def test_instance_images_sizes_the_cached_embeddings_for_a_known_count(cli_env: dict[str, str]) -> None:
    cached = {}
    for count in ("4", "8"):
        code, report = plan_json([*EIGHTY_GIB_CARD, *FLUX_DEV, "--instance-images", count, *LONGEST_DEADLINE], cli_env)
        assert code == EXIT_OK
        cached[count] = report["chosen"]["breakdown"]["host.cached_embeddings"]
    assert cached["8"] == 2 * cached["4"]


def test_plan_table_shows_the_base_precision_and_every_phase(cli_env: dict[str, str]) -> None:
    code, output = run_cli(["plan", *FLUX_DEV, *RUNPOD_TIERS["24 GiB RTX 4090"], *LONGEST_DEADLINE], cli_env)
    assert code == EXIT_OK
    assert (
        "chosen: lora over a bf16 base with ZeRO-2, offload optimizer none, parameters none, frozen blocks swapped in "
        "from host RAM" in output
    )
    assert "phase         GPU peak  host peak  time" in output
    assert all(
        f"\n{phase} " in output
        for phase in ("loading", "caching", "class_images", "training", "validation", "export", "scoring", "report")
    )


# ---- plan on an 8 GiB card: only strategies the trainer runs (issue 11) ---------------------------------

EIGHT_GIB_A4000 = ["--gpu-name", "NVIDIA RTX A4000", "--gpu-memory", "8GiB", "--host-memory", "62GiB"]


def test_an_8_gib_card_plans_the_default_lora_at_512_streaming_the_bf16_base_from_host_ram(
    cli_env: dict[str, str],
) -> None:
    code, report = plan_json(
        [*FLUX_DEV, *EIGHT_GIB_A4000, "--training-type", "lora", "--resolution", "512", *LONGEST_DEADLINE], cli_env
    )
    assert code == EXIT_OK
    chosen = report["chosen"]
    assert (chosen["base_precision"], chosen["zero_stage"], chosen["offload_param"], chosen["block_swap"]) == (
        "bf16",
        2,
        "none",
        True,
    )


def test_no_candidate_offloads_a_quantised_base(cli_env: dict[str, str]) -> None:
    _, report = plan_json([*FLUX_DEV, *EIGHT_GIB_A4000, "--training-type", "lora", "--resolution", "512"], cli_env)
    quantised = {
        (c["base_precision"], c["zero_stage"], c["offload_optimizer"], c["offload_param"])
        for c in report["candidates"]
        if c["base_precision"] != "bf16"
    }
    assert quantised == {(base, 2, optimizer, "none") for base in ("fp8", "nf4") for optimizer in ("none", "cpu")}


def test_an_8_gib_card_with_32_gib_host_plans_the_default_lora_at_512_streaming_an_fp8_base(
    cli_env: dict[str, str],
) -> None:
    # ZeRO-3's offloaded bf16 base needs ≈31.0 GiB + 10 % of host RAM, a block-swapped bf16 base ≈29.8 GiB + 10 %
    # (sized for the dataset cap): the fp8 base's blocks stream from host RAM instead.
    small_host = [*EIGHT_GIB_A4000[:-1], "32GiB"]
    code, report = plan_json(
        [*FLUX_DEV, *small_host, "--training-type", "lora", "--resolution", "512", *LONGEST_DEADLINE], cli_env
    )
    assert code == EXIT_OK
    chosen = report["chosen"]
    assert (chosen["base_precision"], chosen["zero_stage"], chosen["offload_param"], chosen["block_swap"]) == (
        "fp8",
        2,
        "none",
        True,
    )
    assert chosen["gpu_bytes"] * 1.1 <= 8 * GIB and chosen["host_bytes"] * 1.1 <= 32 * GIB


def test_an_8_gib_card_at_1024_and_the_default_deadline_is_refused_naming_steps_timeout_or_a_faster_gpu(
    cli_env: dict[str, str],
    tmp_path: Path,
) -> None:
    # Without validation renders, which at 1024² on this card would take the deadline's time for steps on their own.
    request = tmp_path / "request.json"
    request.write_text(
        json.dumps(
            {
                "model_name": "m",
                "dataset_url": "https://example.com/d.zip",
                "instance_prompt": "a sks dog",
                "validation_prompts": [],
            }
        )
    )
    code, report = plan_json(
        [
            "--request",
            str(request),
            *FLUX_DEV,
            *EIGHT_GIB_A4000,
            "--training-type",
            "lora",
            "--resolution",
            "1024",
            "--cached",
        ],
        cli_env,
    )
    assert code == EXIT_FAILED
    assert report["error"]["message"] == (
        "steps: 1000 steps at ≈6.2 s/step with LoRA rank 16 with ZeRO-2, no offload, frozen blocks swapped in from "
        "host RAM, with every phase (caching ≈4 min, training ≈104 min), take ≈1.8 h, beyond the job deadline of "
        "9 min; use about 39 steps, or timeout_seconds 8220 (and an endpoint execution timeout above it), or a "
        "faster GPU"
    )


# ---- plan reads numbers and names as people type them, and plans as the worker does (issue 22) ----------

TIER_4090 = [*FLUX_DEV, *RUNPOD_TIERS["24 GiB RTX 4090"]]


@pytest.mark.parametrize("flag", ["--gpu-memory", "--host-memory", "--disk"])
def test_a_size_without_a_unit_is_refused_with_the_unit_it_probably_meant(
    cli_env: dict[str, str], capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["plan", *TIER_4090, flag, "24"], cli_env, io.StringIO())
    assert caught.value.code == EXIT_USAGE
    assert f"argument {flag}: '24' has no unit; did you mean 24GiB?" in capsys.readouterr().err


def test_gpu_memory_24gib_plans_a_24_gib_card(cli_env: dict[str, str]) -> None:
    _, report = plan_json(
        ["--gpus", "1", "--gpu-memory", "24GiB", "--host-memory", "62GiB", "--cpus", "16", "--disk", "200GiB"], cli_env
    )
    assert [gpu["total_bytes"] for gpu in report["hardware"]["gpus"]] == [24 * GIB]
    assert report["hardware"]["host_available_bytes"] == 62 * GIB


def test_a_decimal_unit_is_read_as_decimal(cli_env: dict[str, str]) -> None:
    _, report = plan_json([*TIER_4090, "--gpu-memory", "24GB", *LONGEST_DEADLINE], cli_env)
    assert report["hardware"]["gpus"][0]["total_bytes"] == 24 * 10**9


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "invalid request: --steps: Input should be greater than or equal to 1"),
        (["--steps", "-5"], "invalid request: --steps: Input should be greater than or equal to 1"),
        (["--batch-size", "0"], "invalid request: --batch-size: Input should be greater than or equal to 1"),
        (["--lora-rank", "0"], "invalid request: --lora-rank: Input should be greater than or equal to 1"),
        (["--deadline", "10"], "invalid request: --deadline: Input should be greater than or equal to 60"),
        (
            ["--resolution", "1000"],
            "invalid request: --resolution: each size must be a multiple of 16 between 64 and 2048, got 1000",
        ),
        (["--zero-stage", "4"], "invalid request: --zero-stage: Input should be 'auto', 1, 2 or 3"),
    ],
)
def test_a_job_flag_outside_the_requests_bounds_is_refused_as_the_worker_refuses_it(
    cli_env: dict[str, str], flags: list[str], message: str
) -> None:
    code, report = plan_json([*TIER_4090, *flags], cli_env)
    assert code == EXIT_USAGE
    assert report["error"] == {"code": "invalid_input", "message": message}


def test_the_workers_refusal_names_the_field_where_plan_names_the_flag(cli_env: dict[str, str]) -> None:
    from fluxbooth.cli.plan.job_request import SIZING_STAND_INS
    from fluxbooth.errors import FluxboothError
    from fluxbooth.request.model import parse_request

    with pytest.raises(FluxboothError) as worker:
        parse_request({**SIZING_STAND_INS, "steps": 0})
    _, report = plan_json([*TIER_4090, "--steps", "0"], cli_env)
    assert report["error"]["message"] == worker.value.message.replace("input.steps", "--steps")


def test_a_lora_flag_on_a_full_fine_tune_is_refused_as_the_worker_refuses_it(cli_env: dict[str, str]) -> None:
    code, report = plan_json([*TIER_4090, "--training-type", "full", "--lora-rank", "8"], cli_env)
    assert code == EXIT_USAGE
    assert report["error"]["message"] == (
        "invalid request: --lora-rank: only apply when --training-type is 'lora'; remove them or set training_type 'lora'"
    )


@pytest.mark.parametrize("count", ["0", "2", "1001"])
def test_an_instance_image_count_the_worker_would_refuse_is_refused(cli_env: dict[str, str], count: str) -> None:
    code, report = plan_json([*TIER_4090, "--instance-images", count], cli_env)
    assert code == EXIT_USAGE
    assert report["error"]["message"] == (
        f"--instance-images {count}: the worker accepts 3 to 1000 instance images (FLUXBOOTH_MIN_IMAGES, FLUXBOOTH_MAX_IMAGES)"
    )


def test_prior_preservation_plans_the_requests_class_images(cli_env: dict[str, str]) -> None:
    _, report = plan_json([*TIER_4090, "--prior-preservation", *LONGEST_DEADLINE], cli_env)
    assert report["job"]["class_images"] == 50


def test_without_deadline_plan_uses_the_workers_deadline_setting(cli_env: dict[str, str]) -> None:
    _, default = plan_json(TIER_4090, cli_env)
    _, configured = plan_json(TIER_4090, {**cli_env, "FLUXBOOTH_JOB_DEADLINE_SECONDS": "7200"})
    assert default["deadline_seconds"] == WorkerSettings.from_environ(cli_env).job_deadline_seconds
    assert configured["deadline_seconds"] == 7200
    assert configured["deadline_source"] == "the worker's FLUXBOOTH_JOB_DEADLINE_SECONDS"


def test_the_default_request_on_an_rtx_4090_gets_the_answer_the_worker_gives(cli_env: dict[str, str]) -> None:
    from fluxbooth.cli.plan.job_request import SIZING_STAND_INS
    from fluxbooth.host.hardware import hypothetical_hardware
    from fluxbooth.plan import choose_plan, model_size
    from fluxbooth.request.model import parse_request
    from fluxbooth.request.spec import resolve_job_spec

    # An endpoint set up for hour-long jobs: at the default 540 s the request is refused (the test above).
    env = {**cli_env, "FLUXBOOTH_JOB_DEADLINE_SECONDS": "3540"}
    # The worker's plan here is for a base model already cached.
    code, report = plan_json([*TIER_4090, "--cached"], env)
    settings = WorkerSettings.from_environ(env)
    card = hypothetical_hardware(
        gpus=1,
        gpu_memory_bytes=24 * GIB,
        host_memory_bytes=62 * GIB,
        disk_bytes=200 * GIB,
        cpu_count=16,
        gpu_name="NVIDIA GeForce RTX 4090",
    )
    # What job.py's planning step calls, with the worker's deadline and dataset cap.
    model = model_size("black-forest-labs/FLUX.1-dev")
    worker = choose_plan(
        resolve_job_spec(parse_request(dict(SIZING_STAND_INS)), model, settings),
        card,
        model,
        deadline_seconds=settings.job_deadline_seconds,
        instance_images=settings.dataset_limits.max_images,
    )
    assert code == EXIT_OK
    assert report["plan"] == worker.to_dict()


def test_a_deadline_flag_lets_the_same_request_plan(cli_env: dict[str, str]) -> None:
    code, report = plan_json([*TIER_4090, "--deadline", "9000"], cli_env)
    assert code == EXIT_OK
    assert (report["deadline_seconds"], report["deadline_source"]) == (9000, "--deadline / timeout_seconds")


@pytest.mark.parametrize("typed", ["4090", "rtx4090", "RTX 4090", "rtx-4090", "NVIDIA GeForce RTX 4090"])
def test_gpu_names_are_matched_as_people_type_them_and_the_match_is_printed(
    cli_env: dict[str, str], typed: str
) -> None:
    card = [*TIER_4090, "--gpu-name", typed, *LONGEST_DEADLINE]
    _, report = plan_json(card, cli_env)
    _, table = run_cli(["plan", *card], cli_env)
    assert report["gpu_name"] == {"given": typed, "matched": "GeForce RTX 4090"}
    assert f"gpu      {typed!r} read as GeForce RTX 4090\n" in table
    assert not any("not in the planner's table" in warning for warning in report["warnings"])


def test_a_gpu_name_that_matches_no_card_is_refused_listing_the_known_ones(cli_env: dict[str, str]) -> None:
    code, report = plan_json([*TIER_4090, "--gpu-name", "rtx4900"], cli_env)
    assert code == EXIT_USAGE
    assert report["error"]["message"].startswith("--gpu-name 'rtx4900' matches no card the planner knows (RTX A4000, ")
    assert report["error"]["message"].endswith("); leave --gpu-name out to time the job as an unknown card")


@pytest.mark.parametrize(
    ("flags", "missing"),
    [
        (["--gpu-memory", "80GiB", "--host-memory", "256GiB"], "--gpus, --cpus, --disk"),
        (["--gpus", "1", "--gpu-memory", "24GiB", "--host-memory", "62GiB", "--disk", "200GiB"], "--cpus"),
        (["--gpus", "0"], "--host-memory, --cpus, --disk"),
        (["--gpu-name", "4090"], "--gpus, --gpu-memory, --host-memory, --cpus, --disk"),
    ],
)
def test_hypothetical_hardware_given_in_part_is_refused_naming_what_is_missing(
    cli_env: dict[str, str], flags: list[str], missing: str
) -> None:
    code, report = plan_json(["--base-model", "black-forest-labs/FLUX.1-dev", *flags], cli_env)
    assert code == EXIT_USAGE
    assert report["error"]["message"] == (
        f"hypothetical hardware needs {missing} as well: give all of --gpus, --gpu-memory, --host-memory, --cpus "
        "and --disk (--gpus 0: no --gpu-memory), or none to plan for this machine; its own values are never mixed in"
    )


def test_a_cpu_only_machine_with_gpu_memory_is_refused(cli_env: dict[str, str]) -> None:
    code, report = plan_json([*CPU_ONLY_MACHINE, "--gpu-memory", "24GiB"], cli_env)
    assert code == EXIT_USAGE
    assert report["error"]["message"] == "--gpus 0 describes a machine without a GPU: drop --gpu-memory and --gpu-name"


def test_hypothetical_hardware_is_only_what_the_flags_say(cli_env: dict[str, str]) -> None:
    _, report = plan_json([*TIER_4090, "--cpus", "6", *LONGEST_DEADLINE], cli_env)
    hardware = report["hardware"]
    assert (hardware["source"], hardware["cpu_count"], hardware["disk_free_bytes"]) == ("hypothetical", 6, 200 * GIB)
    assert hardware["host_total_bytes"] == hardware["host_available_bytes"] == 62 * GIB


def test_a_reader_that_closes_the_pipe_early_ends_plan_quietly(cli_env: dict[str, str]) -> None:
    reader, writer = os.pipe()
    os.close(reader)  # as `plan | head` once head has its lines: every write now meets a closed pipe
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "fluxbooth", "plan", *TIER_4090],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env,
            timeout=120,
            check=False,
        )
    finally:
        os.close(writer)
    assert (completed.returncode, completed.stderr) == (EXIT_CLOSED_PIPE, "")


# ---- hostile input to plan (issue 29, items 5 and 9) ------------------------------------------------


def test_a_plan_refusal_naming_several_flags_names_every_one(cli_env: dict[str, str]) -> None:
    code, output = run_cli(
        [
            "plan",
            *EIGHTY_GIB_CARD,
            "--base-model",
            "black-forest-labs/FLUX.1-dev",
            "--training-type",
            "full",
            "--fused-backward-pass",
            "true",
            "--gradient-accumulation-steps",
            "2",
            "--mixed-precision",
            "fp16",
            "--json",
        ],
        cli_env,
    )
    assert code == EXIT_USAGE
    assert json.loads(output)["error"]["message"] == (
        "invalid request: --fused-backward-pass, --gradient-accumulation-steps: each weight is stepped as its gradient "
        "appears: no gradient buffer to accumulate in; use gradient_accumulation_steps 1; --fused-backward-pass, "
        "--mixed-precision: the fused pass trains bf16 weights; use mixed_precision 'bf16'"
    )


def test_a_request_file_nested_100000_deep_is_a_clean_invalid_input(cli_env: dict[str, str], tmp_path: Path) -> None:
    request = tmp_path / "deep.json"
    request.write_text("[" * 100_000)
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth", "plan", *EIGHT_GIB_CARD, "--request", str(request)],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == EXIT_USAGE
    assert (
        completed.stderr
        == f"error (invalid_input): --request {request}: nested 100,000 levels deep, over the bound of 64\n"
    )


def test_a_request_file_of_400_kb_of_escaped_quotes_is_invalid_input_within_a_second(
    cli_env: dict[str, str], tmp_path: Path
) -> None:
    request = tmp_path / "quotes.json"
    request.write_text('"' + '\\"' * 200_000)
    started = time.monotonic()
    code, output = run_cli(["plan", *EIGHT_GIB_CARD, "--request", str(request), "--json"], cli_env)
    assert time.monotonic() - started < 1.0
    assert code == EXIT_USAGE
    assert json.loads(output)["error"]["message"] == f"--request {request}: not a readable JSON file (JSONDecodeError)"
