"""A finished job's result: what the caller receives when the weights are stored (the error contract's shape is
`FluxboothError.to_result`). Torch-free, like everything the worker process imports."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fluxbooth.messages import bounded_warnings
from fluxbooth.plan import Plan


@dataclass(frozen=True)
class JobResult:
    """Everything a successful job reports, typed; `to_dict` is the JSON the caller receives."""

    model_name: str
    artifacts: Sequence[Mapping[str, Any]]  # each stored artifact's name, uri, url, bytes and sha256
    plan: Plan
    export_formats: Sequence[str]
    trainer_metrics: Mapping[str, Any]  # the trainer's `done` metrics
    stage_seconds: Mapping[str, float]  # the worker's own stages, timed
    dataset: Mapping[str, Any]  # the prepared dataset's summary
    checks: Mapping[str, Any]  # the dataset checks' findings
    checkpoints: Sequence[str]  # the URIs of the checkpoints stored during training
    warnings: Sequence[str]  # the worker's warnings, then the trainer's
    # The likeness section (fluxbooth.contract.scoring; docs/result.md), when the job scored its renders.
    likeness: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The result's JSON: the trainer's seconds beside the worker's stages', the warnings each once and bounded,
        the likeness section when there is one."""
        result = {
            "model_name": self.model_name,
            "artifacts": list(self.artifacts),
            "plan": {**self.plan.to_dict(), "export_formats": list(self.export_formats)},
            "metrics": {
                **self.trainer_metrics,
                "seconds": {**self.trainer_metrics.get("seconds", {}), **self.stage_seconds},
            },
            "dataset": {**self.dataset, "checks": dict(self.checks)},
            "checkpoints": list(self.checkpoints),
            "warnings": bounded_warnings(self.warnings),
        }
        if self.likeness is not None:
            result["likeness"] = dict(self.likeness)
        return result
