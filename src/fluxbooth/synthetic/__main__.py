"""`python -m fluxbooth.synthetic --preset NAME [--count] [OUT]`: build a synthetic FLUX pipeline."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fluxbooth.host.hardware import parse_bytes
from fluxbooth.synthetic.build import build_pipeline, count_parameters
from fluxbooth.synthetic.presets import PRESET_NAMES, Preset, preset
from fluxbooth.synthetic.tiny import build_tiny_pipeline


def _layers(text: str) -> tuple[int, int]:
    try:
        double, single = (int(part) for part in text.split(","))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--layers {text!r}: write DOUBLE,SINGLE, e.g. 2,4") from error
    return double, single


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fluxbooth.synthetic", description=__doc__.split(":")[1].strip())
    parser.add_argument("out_dir", type=Path, nargs="?", help="folder to write the pipeline to (reused when complete)")
    parser.add_argument("--preset", required=True, choices=PRESET_NAMES)
    parser.add_argument(
        "--count", action="store_true", help="print each component's parameter count as JSON; build nothing"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    parser.add_argument("--device", default="cpu", help="where each shard is initialised: cpu or cuda (faster)")
    parser.add_argument(
        "--layers",
        type=_layers,
        help="DOUBLE,SINGLE transformer blocks instead of the preset's (reduced-depth variants)",
    )
    parser.add_argument(
        "--share-encoders-with",
        type=Path,
        metavar="FOLDER",
        help="write only the transformer; link the encoders, VAE, tokenizers and scheduler to this built pipeline",
    )
    parser.add_argument(
        "--max-shard-size",
        type=_size,
        help="largest weights file, e.g. 2GB (default: diffusers' 10GB, transformers' 5GB)",
    )
    return parser


def chosen_preset(arguments: argparse.Namespace) -> Preset:
    chosen = preset(arguments.preset)
    if arguments.layers is not None:
        chosen = chosen.with_layers(*arguments.layers)
    if arguments.max_shard_size is not None:
        chosen = chosen.with_max_shard_bytes(arguments.max_shard_size)
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    arguments = parser.parse_args(argv)
    try:
        chosen = chosen_preset(arguments)
    except ValueError as error:
        parser.error(str(error))
    if arguments.count:
        print(json.dumps(count_parameters(chosen), indent=2), flush=True)
        return 0
    if arguments.out_dir is None:
        parser.error("OUT is required unless --count is given")
    plain_tiny = arguments.layers is None and arguments.max_shard_size is None and arguments.share_encoders_with is None
    if chosen.name == "tiny" and plain_tiny:
        path = build_tiny_pipeline(arguments.out_dir, seed=arguments.seed)
    else:
        try:
            path = build_pipeline(
                chosen,
                arguments.out_dir,
                seed=arguments.seed,
                device=arguments.device,
                share_encoders_with=arguments.share_encoders_with,
            )
        except ValueError as error:
            parser.error(str(error))
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
