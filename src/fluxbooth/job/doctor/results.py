"""What one check of the doctor finds: its name, a status (ok, warn, fail, skip) and the detail a person reads."""

from __future__ import annotations

from dataclasses import dataclass, field

OK = "ok"
WARN = "warn"
FAIL = "fail"
SKIP = "skip"


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    # The numbers behind the detail, for `doctor --json` (the container's limits); empty for most checks.
    values: dict[str, int | bool | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        data: dict[str, object] = {"name": self.name, "status": self.status, "detail": self.detail}
        if self.values:
            data["values"] = dict(self.values)
        return data
