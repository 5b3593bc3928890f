"""`python -m fluxbooth ...` (**contract**): `plan`, `doctor`, `train`, `submit`, `score` and `caption`.

plan    — which memory strategy a job gets on this machine or on hypothetical hardware described whole
          (`--gpus 1 --gpu-memory 24GiB --host-memory 62GiB --cpus 16 --disk 200GiB --gpu-name 4090`), with the
          request's bounds on every job flag and the worker's deadline; exits 1 when the worker would refuse the job.
doctor  — is this machine ready to train; exits 1 when a check fails (`--allow-cpu` on CPU-only hosts).
train   — run one request (a JSON file holding the `input` object, or `{"input": {...}}`) outside RunPod;
          prints the result JSON; exits 1 when the job failed. Progress goes to stderr (a bar on a
          terminal, plain lines otherwise); `--verbose` adds the full log.
submit  — send photos and a request to an endpoint (RunPod or a local API server), follow the job and download
          its files (fluxbooth.client; its own exit codes, listed in `submit --help`).
score   — how much a folder of renders looks like a folder of photos (likeness, copies, prompt fidelity), from a
          LoRA trained anywhere; prints one JSON object (fluxbooth.cli.score).
caption — caption a folder of photos as a job with `captioning: "missing"` would, into `<stem>.txt` files to
          read and edit before submitting (fluxbooth.cli.caption).

Exit codes (fluxbooth.cli.exits): 0 success, 1 does not fit / a check failed, 2 invalid arguments or input,
141 the reader closed the output early (`plan | head`), quietly.
This package never imports torch: doctor runs its torch checks in a child process. One module per subcommand
(cli/plan/, cli/doctor.py, cli/train.py, cli/score.py, fluxbooth/client/command.py); the table below wires them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from fluxbooth.cli.caption import add_caption_parser, run_caption_command
from fluxbooth.cli.doctor import add_doctor_parser, run_doctor_command
from fluxbooth.cli.exits import EXIT_CLOSED_PIPE, EXIT_FAILED, EXIT_USAGE
from fluxbooth.cli.plan import run_plan_command
from fluxbooth.cli.plan.flags import add_plan_parser
from fluxbooth.cli.score import add_score_parser, run_score_command
from fluxbooth.cli.train import add_train_parser, run_train_command
from fluxbooth.client.command import add_submit_parser, run_submit_command
from fluxbooth.errors import ErrorCode, FluxboothError

Command = Callable[[argparse.Namespace, Mapping[str, str], TextIO], int]
# Each subcommand: (adds its parser, runs it), in the order `--help` lists them.
COMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], Command]] = {
    "plan": (add_plan_parser, run_plan_command),
    "doctor": (add_doctor_parser, run_doctor_command),
    "train": (add_train_parser, run_train_command),
    "submit": (add_submit_parser, run_submit_command),
    "score": (add_score_parser, run_score_command),
    "caption": (add_caption_parser, run_caption_command),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fluxbooth", description="fluxbooth: FLUX.1 DreamBooth under DeepSpeed"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (add_parser, run) in COMMANDS.items():
        add_parser(subparsers)
        subparsers.choices[name].set_defaults(handler=run)
    return parser


def _run(arguments: argparse.Namespace, environ: Mapping[str, str], stream: TextIO) -> int:
    try:
        return int(arguments.handler(arguments, environ, stream))
    except FluxboothError as error:
        if getattr(arguments, "json", False):
            stream.write(json.dumps(error.to_result(), indent=2) + "\n")
        else:
            sys.stderr.write(f"error ({error.code.value}): {error.message}\n")
        return EXIT_USAGE if error.code is ErrorCode.INVALID_INPUT else EXIT_FAILED


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None, out: TextIO | None = None) -> int:
    parser = build_parser()
    arguments = parser.parse_args(argv)
    stream = out or sys.stdout
    try:
        code = _run(arguments, dict(os.environ if environ is None else environ), stream)
        stream.flush()
    except BrokenPipeError:
        # The reader has gone (`plan | head`): what it read is all it wanted. Point stdout at /dev/null so
        # the interpreter's last flush does not fail again, and end as a process killed by SIGPIPE would.
        if stream is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_CLOSED_PIPE
    return code
