"""artifacts.py: what the trainer announced is checked byte for byte before any upload."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.storage.artifacts import collect_artifacts, verify_safetensors


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    encoded = json.dumps(header).encode()
    blob = struct.pack("<Q", len(encoded)) + encoded + data
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    return blob


def test_well_formed_file_reports_its_tensor_count(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": ("F32", [2, 2], b"\0" * 16), "b": ("BF16", [3], b"\0" * 6)})
    assert verify_safetensors(path) == 2


def test_file_written_by_the_safetensors_library_verifies(tmp_path: Path) -> None:
    import numpy
    from safetensors.numpy import save_file

    path = tmp_path / "lib.safetensors"
    save_file({"x": numpy.ones((3, 5), dtype=numpy.float32), "y": numpy.zeros(7, dtype=numpy.float16)}, str(path))
    assert verify_safetensors(path) == 2


def test_truncated_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    blob = write_safetensors(path, {"a": ("F32", [4], b"\0" * 16)})
    path.write_bytes(blob[:-3])
    with pytest.raises(FluxboothError) as caught:
        verify_safetensors(path)
    assert caught.value.code == ErrorCode.TRAINER_FAILED
    assert caught.value.message == (
        "exported file cut.safetensors is not valid safetensors: data section is 13 bytes but the tensors cover 16 (truncated?)"
    )


def test_shape_that_disagrees_with_the_byte_span_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    write_safetensors(path, {"a": ("F32", [5], b"\0" * 16)})
    with pytest.raises(FluxboothError, match="tensor 'a' spans 16 bytes, its shape needs 20"):
        verify_safetensors(path)


def test_garbage_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(FluxboothError, match="header is not JSON"):
        verify_safetensors(path)


def test_folders_expand_to_their_files_with_size_and_sha256(tmp_path: Path) -> None:
    blob = write_safetensors(
        tmp_path / "transformer" / "diffusion_pytorch_model.safetensors", {"a": ("F32", [1], b"\0" * 4)}
    )
    (tmp_path / "transformer" / "config.json").write_text("{}")
    artifacts = collect_artifacts(tmp_path, [{"name": "transformer", "path": "transformer", "kind": "diffusers"}])
    assert [(a.name, a.bytes, a.kind) for a in artifacts] == [
        ("transformer/config.json", 2, "diffusers"),
        ("transformer/diffusion_pytorch_model.safetensors", len(blob), "diffusers"),
    ]
    assert artifacts[1].sha256 == hashlib.sha256(blob).hexdigest()


def test_announced_path_outside_the_output_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    write_safetensors(tmp_path / "elsewhere.safetensors", {"a": ("F32", [1], b"\0" * 4)})
    with pytest.raises(FluxboothError, match="'../elsewhere.safetensors', which is not in its output directory"):
        collect_artifacts(tmp_path / "out", [{"name": "x", "path": "../elsewhere.safetensors"}])


def test_an_export_without_any_weights_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(FluxboothError, match="exported no safetensors weights"):
        collect_artifacts(tmp_path, [{"name": "notes", "path": "notes.txt"}])


def test_validation_images_of_each_training_step_keep_their_step_folder_in_the_name(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "lora" / "pytorch_lora_weights.safetensors", {"a": ("F32", [1], b"\0" * 4)})
    (tmp_path / "validation" / "step-000002").mkdir(parents=True)
    (tmp_path / "validation" / "step-000002" / "validation_00.png").write_bytes(b"png at step 2")
    (tmp_path / "validation" / "validation_00.png").write_bytes(b"png at the end")
    announced = [
        {"name": "lora", "path": "lora/pytorch_lora_weights.safetensors", "kind": "lora_diffusers"},
        {
            "name": "validation_step000002_00",
            "path": "validation/step-000002/validation_00.png",
            "kind": "validation_image",
        },
        {"name": "validation_00", "path": "validation/validation_00.png", "kind": "validation_image"},
    ]
    artifacts = collect_artifacts(tmp_path, announced)
    assert [(a.name, a.kind) for a in artifacts[1:]] == [
        ("validation/step-000002/validation_00.png", "validation_image"),
        ("validation/validation_00.png", "validation_image"),
    ]
