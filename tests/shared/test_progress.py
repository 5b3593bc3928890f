"""progress.py: what a person sees of a job's progress on a terminal and in a log."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

from fluxbooth.contract.events import StageEvent, StepEvent
from fluxbooth.progress import ProgressBar, ProgressReporter, bar, describe, format_duration

# What `progress.ProgressReporter` sends for a short job, with the second each payload arrives.
JOB_PAYLOADS: list[tuple[float, dict[str, Any]]] = [
    (0.0, {"stage": "plan"}),
    (0.4, {"stage": "dataset"}),
    (1.0, {"stage": "launch", "steps": 4}),
    (19.0, {"stage": "load", "what": "transformer"}),
    (40.0, {"stage": "cache"}),
    (42.0, {"stage": "train", "optimizer": "DeepSpeedCPUAdam", "start_step": 0, "steps": 4}),
    (46.0, {"stage": "train", "step": 1, "total": 4, "loss": 0.51234, "eta_seconds": 12.0}),
    (50.0, {"stage": "train", "step": 2, "total": 4, "loss": 0.4, "eta_seconds": 8.0}),
    (54.0, {"stage": "train", "step": 3, "total": 4, "loss": 0.3, "eta_seconds": 4.0}),
    (58.0, {"stage": "train", "step": 4, "total": 4, "loss": 0.25, "eta_seconds": 0.0}),
    (58.5, {"stage": "export", "formats": ["diffusers", "comfyui"]}),
    (60.0, {"stage": "upload"}),
]


def render(interactive: bool, payloads: list[tuple[float, dict[str, Any]]] = JOB_PAYLOADS) -> str:
    times: Iterator[float] = iter(second for second, _ in payloads)
    stream = io.StringIO()
    progress = ProgressBar(stream, interactive=interactive, clock=lambda: next(times), plain_interval=5.0)
    for _, payload in payloads:
        progress(payload)
    progress.close()
    return stream.getvalue()


def test_durations_are_minutes_and_seconds_and_hours_from_an_hour_on() -> None:
    assert [format_duration(seconds) for seconds in (0, 9.6, 75, 3725)] == ["0:00", "0:10", "1:15", "1:02:05"]


def test_the_bar_fills_in_proportion_and_never_overflows() -> None:
    assert bar(3, 8, width=8) == "[###-----]"
    assert bar(9, 8, width=8) == "[########]"
    assert bar(0, 0, width=4) == "[----]"


def test_a_step_shows_the_stage_bar_step_of_total_loss_and_eta() -> None:
    payload = {"stage": "train", "step": 3, "total": 8, "loss": 0.43219, "eta_seconds": 75.2}
    assert describe(payload) == "train  [#########---------------]  3/8  loss 0.4322  ETA 1:15"


def test_a_download_shows_bytes_done_of_total() -> None:
    payload = {"stage": "download", "bytes_done": 3 * 2**20, "bytes_total": 12 * 2**20}
    assert describe(payload) == "download  [######------------------]  25%  3.0 MiB / 12.0 MiB"


def test_dataset_preparation_shows_images_done_of_total() -> None:
    assert describe({"stage": "dataset", "done": 5, "total": 20}) == "dataset  [######------------------]  5/20"


def test_a_stage_shows_its_details_by_name() -> None:
    assert describe({"stage": "export", "formats": ["diffusers", "comfyui"]}) == "export  formats=diffusers,comfyui"


def test_in_a_log_each_stage_is_one_line_and_steps_at_most_every_interval_and_the_last() -> None:
    assert render(interactive=False).splitlines() == [
        "[0:00] plan",
        "[0:00] dataset",
        "[0:01] launch  steps=4",
        "[0:19] load  what=transformer",
        "[0:40] cache",
        "[0:42] train  optimizer=DeepSpeedCPUAdam  start_step=0  steps=4",
        "[0:46] train  [######------------------]  1/4  loss 0.5123  ETA 0:12",
        "[0:54] train  [##################------]  3/4  loss 0.3000  ETA 0:04",
        "[0:58] train  [########################]  4/4  loss 0.2500  ETA 0:00",
        "[0:58] export  formats=diffusers,comfyui",
        "[1:00] upload",
    ]


def test_on_a_terminal_each_stage_is_a_line_and_its_progress_one_line_redrawn_in_place() -> None:
    assert render(interactive=True) == (
        "[0:00] plan\n"
        "[0:00] dataset\n"
        "[0:01] launch  steps=4\n"
        "[0:19] load  what=transformer\n"
        "[0:40] cache\n"
        "[0:42] train  optimizer=DeepSpeedCPUAdam  start_step=0  steps=4\n"
        "\r[0:46] train  [######------------------]  1/4  loss 0.5123  ETA 0:12"
        "\r[0:50] train  [############------------]  2/4  loss 0.4000  ETA 0:08"
        "\r[0:54] train  [##################------]  3/4  loss 0.3000  ETA 0:04"
        "\r[0:58] train  [########################]  4/4  loss 0.2500  ETA 0:00\n"
        "[0:58] export  formats=diffusers,comfyui\n"
        "[1:00] upload\n"
    )


def test_a_shorter_redraw_pads_over_the_longer_line_before_it() -> None:
    payloads = [
        (0.0, {"stage": "download", "bytes_done": 2**30, "bytes_total": 3 * 2**30}),
        (1.0, {"stage": "download", "bytes_done": 3 * 2**30, "bytes_total": 3 * 2**30}),
    ]
    assert render(interactive=True, payloads=payloads) == (
        "\r[0:00] download  [########----------------]  33%  1.0 GiB / 3.0 GiB"
        "\r[0:01] download  [########################]  100%  3.0 GiB / 3.0 GiB\n"
    )
    shrinking = [
        (0.0, {"stage": "download", "bytes_done": 2**30, "bytes_total": 3 * 2**30}),
        (1.0, {"stage": "download", "bytes_done": 0, "bytes_total": 3 * 2**30}),
    ]
    assert render(interactive=True, payloads=shrinking).endswith(
        "\r[0:01] download  [------------------------]  0%  0 B / 3.0 GiB     \n"
    )


def test_a_job_ending_during_progress_ends_its_line_when_closed() -> None:
    stream = io.StringIO()
    progress = ProgressBar(stream, interactive=True, clock=lambda: 0.0)
    progress({"stage": "train", "step": 1, "total": 2, "loss": 1.0, "eta_seconds": 3.0})
    progress.close()
    progress.close()
    assert stream.getvalue() == "\r[0:00] train  [############------------]  1/2  loss 1.0000  ETA 0:03\n"


def test_for_stream_redraws_only_on_a_terminal() -> None:
    assert ProgressBar.for_stream(io.StringIO()).interactive is False


def test_the_reporter_forwards_a_trainer_stage_with_its_details() -> None:
    sent: list[dict[str, Any]] = []
    ProgressReporter(sent.append).trainer_event(StageEvent(stage="load", details={"what": "transformer"}))
    assert sent == [{"stage": "load", "what": "transformer"}]


def test_the_reporter_sends_steps_at_most_every_interval_and_always_the_last() -> None:
    sent: list[dict[str, Any]] = []
    reporter = ProgressReporter(sent.append, min_interval=3600)
    reporter.stage("train")
    for step in (1, 2, 3):
        reporter.trainer_event(StepEvent(step=step, total=3, loss=0.5, lr=1e-4, seconds_per_step=2.0))
    assert sent == [{"stage": "train"}, {"stage": "train", "step": 3, "total": 3, "loss": 0.5, "eta_seconds": 0.0}]


def test_the_reporter_counts_items_at_most_every_interval_and_always_the_last() -> None:
    sent: list[dict[str, Any]] = []
    reporter = ProgressReporter(sent.append, min_interval=3600)
    reporter.stage("dataset")
    for done in (1, 2, 3):
        reporter.count("dataset", done, 3)
    assert sent == [{"stage": "dataset"}, {"stage": "dataset", "done": 3, "total": 3}]
