"""`python -m fluxbooth caption PHOTOS --out DIR`: the captions a job with `captioning: "missing"` would train on,
written as `<stem>.txt` for each photo without one, by the same process and model as the worker's."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from fluxbooth.cli import main
from fluxbooth.cli.exits import EXIT_OK, EXIT_USAGE
from fluxbooth.contract.captioning import TINY_CAPTIONER
from tests.support.factories import make_image


def photo_folder(root: Path) -> Path:
    folder = root / "photos"
    folder.mkdir()
    for index in range(2):
        (folder / f"photo{index}.png").write_bytes(make_image("PNG", size=(96, 80), color=(40 * index, 90, 160)))
    (folder / "photo1.txt").write_text("my own caption\n", encoding="utf-8")
    return folder


def test_caption_writes_a_caption_for_each_photo_without_one_and_leaves_the_rest(
    tmp_path: Path, model_cache_dir: Path
) -> None:
    out = io.StringIO()
    environ = {"FLUXBOOTH_CACHE_DIR": str(model_cache_dir), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}

    code = main(
        [
            "caption",
            str(photo_folder(tmp_path)),
            "--out",
            str(tmp_path / "captions"),
            "--trigger-word",
            "sks",
            "--class-noun",
            "dog",
            "--subject-type",
            "pet",
            "--model",
            TINY_CAPTIONER,
        ],
        environ=environ,
        out=out,
    )

    summary = json.loads(out.getvalue())
    assert code == EXIT_OK
    assert (summary["status"], list(summary["captions"]), summary["not_captioned"]) == ("captioned", ["photo0.png"], [])
    written = (tmp_path / "captions" / "photo0.txt").read_text(encoding="utf-8")
    assert written.startswith("sks dog") and written == summary["captions"]["photo0.png"] + "\n"
    assert sorted(path.name for path in (tmp_path / "captions").iterdir()) == ["photo0.txt"]


def test_caption_refuses_a_photos_path_that_is_not_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"

    code = main(["caption", str(missing), "--out", str(tmp_path / "out")], environ={}, out=io.StringIO())

    assert code == EXIT_USAGE
    assert capsys.readouterr().err == (
        f"error (invalid_input): photos: {missing} is not a folder; give a folder of images\n"
    )
