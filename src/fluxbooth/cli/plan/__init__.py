"""`python -m fluxbooth plan`: which memory strategy a job gets on this machine or on hypothetical hardware
described whole, with the request's bounds on every job flag and the worker's deadline; exits 1 when the
worker would refuse the job.

flags (the parser), job_request (the request sized), machine (the hardware), table (the answer for people),
command (the run)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TextIO


def run_plan_command(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    # Deferred: the planner (PIL, the quote, ~75 ms) loads only when plan runs; doctor, train and submit start without it.
    from fluxbooth.cli.plan.command import run_plan

    return run_plan(arguments, environ, out)
