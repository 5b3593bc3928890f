"""What the dataset check and the training report add to the demo job (`test_input.json` on the tiny model).

Each run is a fresh interpreter running the handler on test_input.json, as `python handler.py` does, timed
from start to exit. Runs alternate between the worker as it is and the same worker with the two stages
replaced by no-ops (their results empty), so both sides share the machine's load as evenly as a shared
machine allows. The share is also read from each full run's own `metrics.seconds` (checks + report over total).

`python bench/report_overhead.py [pairs]` prints the table and rewrites its section of bench/RESULTS.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "src")]

from bench.overhead import write_section  # noqa: E402
from fluxbooth.job.op_builds import extensions_dir  # noqa: E402
from fluxbooth.settings import WorkerSettings  # noqa: E402

DEFAULT_PAIRS = 3


def without_checks_and_report() -> None:
    """The two stages as no-ops: an empty check (nothing measured) and an empty report (nothing drawn)."""
    import fluxbooth.dataset.checks as checks
    import fluxbooth.report as report

    checks.check_prepared = lambda dataset, shape, mode, on_image=None: checks.DatasetChecks(mode, (), ())
    report.make_report = lambda inputs: report.Report((), ())


def one_run(side: str) -> None:
    """In a fresh interpreter: the handler on test_input.json; prints the result's seconds as JSON."""
    import handler

    if side == "without":
        without_checks_and_report()
    job = json.loads((REPO_ROOT / "test_input.json").read_text())
    result = asyncio.run(handler.handler({"id": f"bench-{side}", **job}))
    if "error" in result:
        raise SystemExit(f"the demo job failed: {result['error']}")
    print(json.dumps(result["metrics"]["seconds"]))


def timed_run(side: str, env: dict[str, str]) -> tuple[float, dict[str, float]]:
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, __file__, "--one", side], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - started
    return wall, json.loads(completed.stdout.strip().splitlines()[-1])


def main(pairs: int) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        env = {
            **os.environ,
            "FLUXBOOTH_WORK_DIR": f"{scratch}/work",
            "FLUXBOOTH_OUTPUT_DIR": f"{scratch}/out",
            "FLUXBOOTH_CACHE_DIR": os.environ.get("FLUXBOOTH_CACHE_DIR", f"{scratch}/cache"),
            "RUNPOD_LOG_LEVEL": "ERROR",
            # DeepSpeed's CPU ops, built once per machine (minutes), not once per run.
            "TORCH_EXTENSIONS_DIR": str(extensions_dir(WorkerSettings.from_environ(os.environ))),
        }
        timed_run("with", env)  # builds the tiny model and warms the caches, not counted
        runs: dict[str, list[tuple[float, dict[str, float]]]] = {"with": [], "without": []}
        for _ in range(pairs):
            for side in ("with", "without"):
                runs[side].append(timed_run(side, env))
    walls = {side: [wall for wall, _ in results] for side, results in runs.items()}
    shares = [(seconds["checks"] + seconds["report"]) / seconds["total"] for _, seconds in runs["with"]]
    pairs_added = [
        with_wall / without_wall - 1 for with_wall, without_wall in zip(walls["with"], walls["without"], strict=True)
    ]
    lines = [
        "## The check and the report in the demo job (`bench/report_overhead.py`)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other engineers' jobs and tests (load average {os.getloadavg()[0]:.1f} at the end) while it "
        f"ran (numbers under contention), Python {platform.python_version()}. `test_input.json` (full fine-tune of "
        f"the tiny model, 8 steps, 4 photos at 64²) in a fresh interpreter per run, {pairs} alternating pairs.",
        "",
        "| worker | wall s per run | median |",
        "|---|---|---:|",
        *(
            f"| {side} the check and the report | {', '.join(f'{wall:.1f}' for wall in walls[side])} | {statistics.median(walls[side]):.1f} |"
            for side in ("with", "without")
        ),
        "",
        "The measurement: the two stages' share of each full run's own time (`metrics.seconds`, checks + report over "
        f"total): {', '.join(f'{100 * share:.1f} %' for share in shares)}. Seconds of each stage in those runs: "
        + "; ".join(
            ", ".join(
                f"{name} {value:.2f}"
                for name, value in seconds.items()
                if name in ("checks", "report", "train", "total")
            )
            for _, seconds in runs["with"]
        )
        + ".",
        "",
        f"The pairs' wall times differ by {', '.join(f'{100 * added:+.1f} %' for added in pairs_added)} (with against "
        f"without; medians {100 * (statistics.median(walls['with']) / statistics.median(walls['without']) - 1):+.1f} %): "
        "the load of the shared machine moved the trainer's time between runs by more than the two stages cost, so "
        "this comparison bounds nothing here; on an idle machine it should match the share above.",
    ]
    table = "\n".join(lines)
    print(table)
    write_section(table, "report_overhead")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one_run(sys.argv[2])
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_PAIRS)
