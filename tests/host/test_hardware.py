"""hardware.py: what the worker really has — GPUs (nvidia-smi), container memory, CPUs, disk.

/proc and /sys are built under tmp_path for the cgroup cases (a real container limit cannot be
set from a test); nvidia-smi is a small script because this machine has no GPU to report.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from fluxbooth.host.hardware import (
    GIB,
    MIB,
    free_disk_bytes,
    hypothetical_hardware,
    parse_bytes,
    parse_nvidia_smi_csv,
    probe_gpus,
    probe_hardware,
    visible_gpus,
)
from fluxbooth.host.limits import allowed_cpus, host_memory, read_cgroup_memory
from fluxbooth.messages import format_bytes

MEMINFO = "MemTotal:       263921212 kB\nMemFree:        100000000 kB\nMemAvailable:   200000000 kB\n"
H100_ROWS = "0, NVIDIA H100 80GB HBM3, 81559, 81004, 9.0\n1, NVIDIA H100 80GB HBM3, 81559, 70000, 9.0\n"


def make_proc(root: Path, *, meminfo: str = MEMINFO, cgroup: str = "0::/\n") -> None:
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(meminfo)
    (root / "proc" / "self" / "cgroup").write_text(cgroup)


def make_cgroup_v2(root: Path, files: dict[str, str], subpath: str = "") -> Path:
    base = root / "sys" / "fs" / "cgroup"
    base.mkdir(parents=True, exist_ok=True)
    (base / "cgroup.controllers").write_text("cpu memory io\n")
    directory = base / subpath if subpath else base
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_text(content)
    return directory


def make_fake_nvidia_smi(directory: Path, stdout: str, exit_code: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvidia-smi"
    payload = directory / "rows.txt"
    payload.write_text(stdout)
    script.write_text(f"#!/bin/sh\ncat '{payload}'\nexit {exit_code}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def path_with(script: Path) -> str:
    """PATH with the fake first, so the script finds `cat` and a real nvidia-smi is shadowed."""
    return f"{script.parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"


# ---- sizes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 * GIB), ("80GB", 80 * 10**9), ("512MiB", 512 * MIB), ("1.5TiB", int(1.5 * 1024**4)), ("1234", 1234)],
)
def test_parse_bytes_reads_binary_and_decimal_units(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_unknown_units_naming_the_text() -> None:
    with pytest.raises(ValueError, match="'8 parsecs' is not a size"):
        parse_bytes("8 parsecs")


def test_format_bytes_uses_binary_units() -> None:
    assert format_bytes(22.17 * GIB) == "22.2 GiB"
    assert format_bytes(512) == "512 B"


# ---- GPUs -----------------------------------------------------------------------------------------


def test_nvidia_smi_rows_become_gpus_with_memory_in_bytes_and_capability() -> None:
    gpus = parse_nvidia_smi_csv(H100_ROWS)
    assert [gpu.index for gpu in gpus] == [0, 1]
    assert gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert gpus[0].total_bytes == 81559 * MIB
    assert gpus[1].free_bytes == 70000 * MIB
    assert gpus[0].compute_capability == (9, 0)
    assert gpus[0].bf16_supported


def test_a_turing_card_has_no_bf16() -> None:
    (gpu,) = parse_nvidia_smi_csv("0, Tesla T4, 15360, 15000, 7.5\n")
    assert not gpu.bf16_supported


def test_rows_with_unreadable_memory_are_skipped() -> None:
    assert parse_nvidia_smi_csv("0, NVIDIA A100 MIG parent, [N/A], [N/A], 8.0\n") == []


def test_probe_gpus_runs_nvidia_smi_and_honours_cuda_visible_devices(tmp_path: Path) -> None:
    script = make_fake_nvidia_smi(tmp_path / "bin", H100_ROWS)
    gpus, note = probe_gpus({"PATH": path_with(script), "CUDA_VISIBLE_DEVICES": "1"})
    assert note is None
    assert [gpu.index for gpu in gpus] == [1]


UUID_ROWS = (
    "0, NVIDIA H100 80GB HBM3, 81559, 81004, 9.0, GPU-3f2a6c1e-0000-4000-8000-000000000000\n"
    "1, NVIDIA H100 80GB HBM3, 81559, 70000, 9.0, GPU-9b7d5e4c-0000-4000-8000-000000000001\n"
)
MIG_LISTING = (
    "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-3f2a6c1e-0000-4000-8000-000000000000)\n"
    "  MIG 3g.40gb     Device  0: (UUID: MIG-aaaa1111-0000-4000-8000-000000000000)\n"
    "  MIG 2g.20gb     Device  1: (UUID: MIG-bbbb2222-0000-4000-8000-000000000000)\n"
    "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-9b7d5e4c-0000-4000-8000-000000000001)\n"
)


def make_fake_nvidia_smi_with_listing(directory: Path, rows: str, listing: str) -> Path:
    """The driver's query rows, and its `-L` listing when asked for it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "rows.txt").write_text(rows)
    (directory / "listing.txt").write_text(listing)
    script = directory / "nvidia-smi"
    script.write_text(
        f"#!/bin/sh\nif [ \"$1\" = -L ]; then cat '{directory / 'listing.txt'}'; else cat '{directory / 'rows.txt'}'; fi\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_cuda_visible_devices_may_name_gpus_by_uuid_or_its_unique_prefix(tmp_path: Path) -> None:
    script = make_fake_nvidia_smi(tmp_path / "bin", UUID_ROWS)
    gpus, note = probe_gpus(
        {"PATH": path_with(script), "CUDA_VISIBLE_DEVICES": "GPU-9b7d5e4c-0000-4000-8000-000000000001"}
    )
    assert note is None and [(gpu.index, gpu.free_bytes) for gpu in gpus] == [(1, 70000 * MIB)]
    gpus, _ = probe_gpus({"PATH": path_with(script), "CUDA_VISIBLE_DEVICES": "GPU-9b7d,GPU-3f2a"})
    assert [gpu.index for gpu in gpus] == [1, 0]


def test_a_mig_instance_is_planned_with_its_profiles_memory(tmp_path: Path) -> None:
    script = make_fake_nvidia_smi_with_listing(tmp_path / "bin", UUID_ROWS, MIG_LISTING)
    gpus, note = probe_gpus(
        {"PATH": path_with(script), "CUDA_VISIBLE_DEVICES": "MIG-bbbb2222-0000-4000-8000-000000000000"}
    )
    assert note is None and len(gpus) == 1
    assert (gpus[0].name, gpus[0].total_bytes, gpus[0].free_bytes) == (
        "NVIDIA H100 80GB HBM3 MIG 2g.20gb",
        20 * 1000**3,
        20 * 1000**3,
    )
    assert gpus[0].compute_capability == (9, 0)


def test_visible_devices_stop_at_the_first_entry_cuda_cannot_use() -> None:
    gpus = parse_nvidia_smi_csv(UUID_ROWS)
    assert [gpu.index for gpu in visible_gpus(gpus, ["1", "GPU-ffff", "0"], "")] == [1]
    assert visible_gpus(gpus, ["MIG-cccc"], MIG_LISTING) == []


# ---- CUDA_VISIBLE_DEVICES read as CUDA reads it (issue 37, item 9) ----------------------------------------


@pytest.mark.parametrize(
    ("visible", "indices"),
    [
        ("0,1", [0, 1]),
        ("1, 0", [1, 0]),
        ("1gpu,0", [1, 0]),  # strtoul: the leading digits
        ("0,GPU-9b7d5e4c", [0]),  # indices then a UUID: CUDA stops at the first entry of the other kind
        ("GPU-9b7d5e4c,1", [1]),
        ("\u0661", []),  # ARABIC-INDIC DIGIT ONE: not an index to CUDA
        ("0,\u0661", [0]),
        ("1,-1,0", [1]),
    ],
)
def test_visible_devices_are_read_as_cuda_reads_them(tmp_path: Path, visible: str, indices: list[int]) -> None:
    script = make_fake_nvidia_smi(tmp_path / "bin", UUID_ROWS)
    gpus, _ = probe_gpus({"PATH": path_with(script), "CUDA_VISIBLE_DEVICES": visible})
    assert [gpu.index for gpu in gpus] == indices


@pytest.mark.parametrize("visible", ["0,0", "1,01", "GPU-9b7d,GPU-9b7d", "GPU-ffff", "", "7"])
def test_a_repeated_or_unknown_device_leaves_no_gpu_with_a_note_naming_the_variable(
    tmp_path: Path, visible: str
) -> None:
    script = make_fake_nvidia_smi(tmp_path / "bin", UUID_ROWS)
    gpus, note = probe_gpus({"PATH": path_with(script), "CUDA_VISIBLE_DEVICES": visible})
    assert gpus == []
    assert note == (
        f"CUDA_VISIBLE_DEVICES={visible!r} leaves CUDA none of the machine's 2 GPUs (an empty, unknown or repeated "
        "entry); list each GPU once, by index or UUID"
    )


def test_an_index_and_the_uuid_of_the_same_gpu_leave_no_gpu() -> None:
    gpus = parse_nvidia_smi_csv(UUID_ROWS)
    assert visible_gpus(gpus, ["GPU-9b7d", "GPU-9b7d5e4c"], "") == []


def test_only_the_first_of_two_mig_slices_is_visible(tmp_path: Path) -> None:
    script = make_fake_nvidia_smi_with_listing(tmp_path / "bin", UUID_ROWS, MIG_LISTING)
    gpus, note = probe_gpus(
        {
            "PATH": path_with(script),
            "CUDA_VISIBLE_DEVICES": "MIG-bbbb2222-0000-4000-8000-000000000000,MIG-aaaa1111-0000-4000-8000-000000000000",
        }
    )
    assert note is None
    assert [(gpu.name, gpu.total_bytes) for gpu in gpus] == [("NVIDIA H100 80GB HBM3 MIG 2g.20gb", 20 * 1000**3)]


def test_an_ambiguous_uuid_prefix_names_no_gpu() -> None:
    gpus = parse_nvidia_smi_csv(UUID_ROWS)
    assert visible_gpus(gpus, ["GPU-"], "") == []


def test_the_pcie_link_is_read_through_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeNvml:
        """nvidia-ml-py's calls the probe makes, for a card in a gen4 x8 slot (no driver on this machine)."""

        NVMLError = RuntimeError

        @staticmethod
        def nvmlInit() -> None: ...

        @staticmethod
        def nvmlDeviceGetHandleByIndex(index: int) -> int:
            return index

        @staticmethod
        def nvmlDeviceGetMaxPcieLinkGeneration(handle: int) -> int:
            return 4

        @staticmethod
        def nvmlDeviceGetMaxPcieLinkWidth(handle: int) -> int:
            return 8

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml)
    script = make_fake_nvidia_smi(tmp_path / "bin", UUID_ROWS)
    gpus, _ = probe_gpus({"PATH": path_with(script)})
    assert [(gpu.pcie_generation, gpu.pcie_width) for gpu in gpus] == [(4, 8), (4, 8)]


def test_without_nvml_the_link_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: nvidia-ml-py is not installed
    script = make_fake_nvidia_smi(tmp_path / "bin", UUID_ROWS)
    gpus, _ = probe_gpus({"PATH": path_with(script)})
    assert {(gpu.pcie_generation, gpu.pcie_width) for gpu in gpus} == {(None, None)}


def test_probe_gpus_without_nvidia_smi_says_why(tmp_path: Path) -> None:
    gpus, note = probe_gpus({"PATH": str(tmp_path)})
    assert gpus == []
    assert "nvidia-smi not found" in note


def test_probe_gpus_reports_a_failing_driver(tmp_path: Path) -> None:
    script = make_fake_nvidia_smi(tmp_path / "bin", "NVIDIA-SMI has failed because it couldn't communicate\n", 9)
    gpus, note = probe_gpus({"PATH": path_with(script)})
    assert gpus == []
    assert note.startswith("nvidia-smi exited 9")


# ---- host memory ----------------------------------------------------------------------------------


def test_without_cgroup_limits_host_memory_is_meminfo(tmp_path: Path) -> None:
    make_proc(tmp_path)
    total, available, limit = host_memory(tmp_path)
    assert total == 263921212 * 1024
    assert available == 200000000 * 1024
    assert limit is None


def test_cgroup_v2_limit_caps_total_and_available_below_meminfo(tmp_path: Path) -> None:
    make_proc(tmp_path)
    make_cgroup_v2(
        tmp_path,
        {"memory.max": str(64 * GIB), "memory.current": str(10 * GIB), "memory.stat": f"inactive_file {2 * GIB}\n"},
    )
    total, available, limit = host_memory(tmp_path)
    assert limit == 64 * GIB
    assert total == 64 * GIB
    # Reclaimable page cache does not count as used.
    assert available == 64 * GIB - 8 * GIB


def test_cgroup_v2_max_means_no_limit(tmp_path: Path) -> None:
    make_proc(tmp_path)
    make_cgroup_v2(tmp_path, {"memory.max": "max\n", "memory.current": "1000\n"})
    assert read_cgroup_memory(tmp_path).limit_bytes is None


def test_cgroup_v2_tightest_limit_on_the_path_to_the_root_wins(tmp_path: Path) -> None:
    make_proc(tmp_path, cgroup="0::/kubepods/pod1/container\n")
    make_cgroup_v2(tmp_path, {"memory.max": str(32 * GIB)}, subpath="kubepods/pod1")
    make_cgroup_v2(tmp_path, {"memory.max": "max", "memory.current": str(GIB)}, subpath="kubepods/pod1/container")
    memory = read_cgroup_memory(tmp_path)
    assert memory.limit_bytes == 32 * GIB
    assert memory.usage_bytes == GIB


def test_cgroup_v1_limit_is_read_and_its_unlimited_sentinel_ignored(tmp_path: Path) -> None:
    make_proc(tmp_path, cgroup="4:memory:/\n")
    memory_dir = tmp_path / "sys" / "fs" / "cgroup" / "memory"
    memory_dir.mkdir(parents=True)
    (memory_dir / "memory.limit_in_bytes").write_text(str(16 * GIB))
    (memory_dir / "memory.usage_in_bytes").write_text(str(4 * GIB))
    (memory_dir / "memory.stat").write_text(f"total_inactive_file {GIB}\n")
    total, available, limit = host_memory(tmp_path)
    assert (total, available, limit) == (16 * GIB, 13 * GIB, 16 * GIB)
    (memory_dir / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert read_cgroup_memory(tmp_path).limit_bytes is None


# ---- CPUs and disk --------------------------------------------------------------------------------


def test_cpu_quota_caps_the_affinity_mask(tmp_path: Path) -> None:
    make_proc(tmp_path)
    make_cgroup_v2(tmp_path, {"cpu.max": "150000 100000\n"})
    assert allowed_cpus(tmp_path) == min(len(os.sched_getaffinity(0)), 2)


def test_without_quota_cpus_are_the_affinity_mask(tmp_path: Path) -> None:
    make_proc(tmp_path)
    make_cgroup_v2(tmp_path, {"cpu.max": "max 100000\n"})
    assert allowed_cpus(tmp_path) == len(os.sched_getaffinity(0))


def test_free_disk_of_a_missing_directory_is_read_from_its_nearest_parent(tmp_path: Path) -> None:
    # Other processes write to the same disk meanwhile: equal to within 1 %.
    assert free_disk_bytes(tmp_path / "not" / "yet" / "created") == pytest.approx(
        shutil.disk_usage(tmp_path).free, rel=0.01
    )


# ---- the whole probe ------------------------------------------------------------------------------


def test_probe_of_this_machine_finds_memory_cpus_and_disk(tmp_path: Path) -> None:
    hardware = probe_hardware(tmp_path, {"PATH": str(tmp_path)})
    assert hardware.accelerator == "cpu"
    assert hardware.gpu_memory_bytes == 0
    assert 0 < hardware.host_available_bytes <= hardware.host_total_bytes
    assert hardware.cpu_count >= 1
    assert hardware.disk_free_bytes > 0
    assert any("nvidia-smi" in note for note in hardware.notes)


def test_probe_with_a_gpu_and_an_nvme_path(tmp_path: Path) -> None:
    script = make_fake_nvidia_smi(tmp_path / "bin", H100_ROWS)
    nvme = tmp_path / "nvme"
    hardware = probe_hardware(tmp_path, {"PATH": path_with(script), "FLUXBOOTH_NVME_PATH": str(nvme)})
    assert hardware.accelerator == "cuda"
    assert hardware.gpu_count == 2
    assert hardware.gpu_memory_bytes == 81559 * MIB
    assert hardware.nvme_path == str(nvme)
    assert hardware.nvme_free_bytes == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.01)


def test_hypothetical_hardware_is_what_the_flags_say() -> None:
    hardware = hypothetical_hardware(gpus=2, gpu_memory_bytes=8 * GIB, host_memory_bytes=64 * GIB, disk_bytes=200 * GIB)
    assert hardware.gpu_count == 2
    assert hardware.gpu_memory_bytes == 8 * GIB
    assert hardware.host_available_bytes == 64 * GIB
    assert hardware.to_dict()["source"] == "hypothetical"
