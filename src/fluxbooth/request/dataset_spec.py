"""The dataset stage's part of the job spec: what fluxbooth.dataset reads to fetch, check and normalise the
request's images, so that the dataset stage, the dry run's count and the plan CLI never read the request itself.

Worker-only (not the trainer's contract): the trainer reads the prepared folders, never these values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.captioning import CaptioningMode
from fluxbooth.request.limits import DatasetCheckMode
from fluxbooth.request.model import TrainingRequest


@dataclass(frozen=True)
class DatasetSpec:
    """Where the dataset and the validation control images come from, and how they are stored and checked."""

    # The zip as base64, or its http(s) link: exactly one is set on a valid request. Kept out of repr(): the zip
    # is megabytes, and a presigned URL carries a signature.
    dataset: str | None = field(repr=False)
    dataset_url: str | None = field(repr=False)
    # Each validation prompt's control image (FLUX.1 Kontext), base64 or a link, in prompt order.
    validation_images: tuple[str, ...] = field(repr=False)
    # The shapes the images are stored to cover, and the shape each trains at.
    resolution: Resolution
    # Whether the zip's class/ images are used (image pairs refuse them).
    with_prior_preservation: bool
    # The request's trigger word, as the prepared dataset's summary reports it.
    trigger_word: str | None
    # The caption of an image without a `.txt`: the request's instance prompt as sent, before the trigger word is
    # put in (report.sheet_images puts it in, once, as the trainer's caption does; the job spec's instance_prompt
    # already holds it).
    caption_default: str
    # fluxbooth.dataset.checks: its findings become warnings, or (strict) refuse the job.
    checks: DatasetCheckMode
    # "missing": the photos without a caption file are captioned before training (fluxbooth.job.captioning_stage).
    captioning: CaptioningMode = "off"


def dataset_spec(request: TrainingRequest) -> DatasetSpec:
    """The dataset stage's values of `request`: none needs the base model, so the plan CLI and the tests build it
    from a request alone."""
    return DatasetSpec(
        dataset=request.dataset,
        dataset_url=request.dataset_url,
        validation_images=tuple(request.validation_images),
        resolution=request.resolution,
        with_prior_preservation=request.with_prior_preservation,
        trigger_word=request.trigger_word,
        caption_default=request.instance_prompt,
        checks=request.dataset_checks,
        captioning=request.captioning,
    )
