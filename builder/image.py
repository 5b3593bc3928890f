"""Build the worker image from the Dockerfile without a Docker daemon, and run commands in it.

    python builder/image.py build                 # base root file system, then the image (cached)
    python builder/image.py run -- COMMAND ...    # COMMAND in the image's working directory (/app)

The Dockerfile's default build, the image RunPod pulls (CUDA torch from PyPI; a CUDA torch runs on a CPU,
where torch.cuda.is_available() is false), with both stages on a Debian bookworm base that mmdebstrap makes
from Debian's packages (`--variant=apt`: apt and nothing else), imported with podman and
built with `buildah bud --isolation chroot` (no daemon, no user namespaces: it runs as root in a container
too). Needs root and Debian's buildah, podman and mmdebstrap.

What is slow is cached on this machine: the base root file system (a tarball under
~/.cache/fluxbooth/image), buildah's layers (a later build rebuilds only what changed: the source layers
after a code change) and pip's downloads (the Dockerfile's cache mounts). This machine's pip settings (its
CA bundle, a local wheel folder or index) are mounted into the build, never copied into the image.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "localhost/fluxbooth-base:bookworm-apt"
IMAGE = "localhost/fluxbooth:ci"
SUITE = "bookworm"
REQUIRED_TOOLS = ("mmdebstrap", "podman", "buildah")
# The pip settings the build's pip takes from this machine's (where packages come from, and how to trust them).
PIP_SETTINGS = ("cert", "find-links", "index-url", "extra-index-url", "trusted-host", "default-timeout")
BUILD_CA_BUNDLE = "/etc/fluxbooth-build-ca.crt"


@dataclass(frozen=True)
class PipSettings:
    """What the build's pip needs of this machine's pip configuration."""

    values: dict[str, str] = field(default_factory=dict)

    def config_text(self) -> str:
        """The settings as the build's /etc/pip.conf; the CA bundle is read where it is mounted."""
        # No progress bars: a build log is a file, not a terminal.
        values = {**self.values, "progress-bar": "off"}
        if "cert" in values:
            values["cert"] = BUILD_CA_BUNDLE
        lines = ["[global]"] + [f"{name} = {value}" for name, value in sorted(values.items())]
        return "\n".join(lines) + "\n"

    def mounts(self) -> list[str]:
        """buildah --volume flags, read-only: the CA bundle at BUILD_CA_BUNDLE (the image's own bundle stays
        its own), and every local folder the settings name at its path: a wheel folder, and the folder above
        a file:// index (its pages link to files beside it, `../files/...`)."""
        flags = []
        for name, value in sorted(self.values.items()):
            for item in value.split():
                path = Path(item.removeprefix("file://"))
                if not path.is_absolute() or not path.exists():
                    continue
                if name.endswith("index-url"):
                    path = path.parent
                target = BUILD_CA_BUNDLE if name == "cert" else str(path)
                flags.append(f"--volume={path}:{target}:ro")
        return flags


def cache_dir(environ: dict[str, str]) -> Path:
    home = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return home / "fluxbooth" / "image"


def missing_tools() -> list[str]:
    from shutil import which

    return [tool for tool in REQUIRED_TOOLS if which(tool) is None]


def pip_settings_from(listing: str) -> PipSettings:
    """`pip config list` output (`global.cert='/etc/ssl/…'`, `:env:.find-links='/opt/wheels'`) as settings."""
    values: dict[str, str] = {}
    for line in listing.splitlines():
        key, _, raw = line.partition("=")
        name = key.rpartition(".")[2]
        if name in PIP_SETTINGS and raw:
            values[name] = raw.strip().strip("'\"")
    return PipSettings(values)


def this_machines_pip_settings() -> PipSettings:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    return pip_settings_from(listing)


def run(command: Sequence[str], log: Path | None = None) -> None:
    print("+", shlex.join(command), file=sys.stderr, flush=True)
    if log is None:
        subprocess.run(command, check=True)
        return
    with log.open("a") as output:
        completed = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT)
    if completed.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{shlex.join(command)} exited {completed.returncode}; last lines of {log}:\n{tail}")


def base_rootfs(cache: Path, log: Path | None) -> Path:
    """A Debian bookworm root file system with apt and nothing else, made once and kept."""
    tarball = cache / f"{SUITE}-apt.tar"
    if not tarball.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = tarball.with_suffix(".partial.tar")
        run(["mmdebstrap", "--variant=apt", SUITE, str(partial)], log)
        partial.rename(tarball)
    return tarball


def image_exists(name: str) -> bool:
    return subprocess.run(["podman", "image", "exists", name]).returncode == 0


def import_base(tarball: Path, log: Path | None) -> str:
    if not image_exists(BASE_IMAGE):
        run(["podman", "import", str(tarball), BASE_IMAGE], log)
    return BASE_IMAGE


def bud_command(settings_file: Path, pip: PipSettings, base: str, tag: str, context: Path) -> list[str]:
    mounts = [f"--volume={settings_file}:/etc/pip.conf:ro", *pip.mounts()]
    return [
        "buildah",
        "bud",
        "--isolation",
        "chroot",
        "--network",
        "host",
        "--layers",
        "--build-arg",
        f"BUILD_BASE={base}",
        "--build-arg",
        f"RUNTIME_BASE={base}",
        *mounts,
        "--tag",
        tag,
        "--file",
        str(context / "Dockerfile"),
        str(context),
    ]


def build(context: Path = REPO_ROOT, tag: str = IMAGE, log: Path | None = None) -> str:
    """The image from the Dockerfile in `context`; returns its name."""
    missing = missing_tools()
    if missing:
        raise RuntimeError(f"missing {', '.join(missing)}: apt-get install buildah podman mmdebstrap (as root)")
    cache = cache_dir(dict(os.environ))
    cache.mkdir(parents=True, exist_ok=True)
    # One build at a time on this machine: CI starts one in the background and the image tests' own call then
    # waits for it and finds every layer cached. flock's lock goes with its process, so a killed build leaves none.
    with (cache / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        base = import_base(base_rootfs(cache, log), log)
        pip = this_machines_pip_settings()
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="fluxbooth-pip-") as folder:
            settings_file = Path(folder) / "pip.conf"
            settings_file.write_text(pip.config_text())
            run(bud_command(settings_file, pip, base, tag, context), log)
    print(f"built {tag} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return tag


@contextmanager
def working_container(image: str) -> Iterator[str]:
    """A fresh container of `image` (buildah's working container), removed afterwards."""
    name = subprocess.run(["buildah", "from", image], capture_output=True, text=True, check=True).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)


def run_command(container: str, command: Sequence[str], environ: dict[str, str] | None = None) -> list[str]:
    """The `buildah run` call for `command` in a container, with extra environment variables. The host's network
    and hostname, as `docker run --network host` gives: torch's elastic agent (accelerate launch) connects to its
    own store at the hostname, which buildah's own per-container hostname is not listed for in /etc/hosts."""
    env_flags = [f"--env={name}={value}" for name, value in (environ or {}).items()]
    return [
        "buildah",
        "run",
        "--isolation",
        "chroot",
        "--network",
        "host",
        "--uts",
        "host",
        *env_flags,
        container,
        "--",
        *command,
    ]


def main(arguments: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help=f"build {IMAGE} from the Dockerfile")
    runner = sub.add_parser("run", help="run a command in a fresh container of the built image")
    runner.add_argument("argv", nargs=argparse.REMAINDER)
    options = parser.parse_args(arguments)
    if options.command == "build":
        print(build())
        return 0
    command = options.argv[1:] if options.argv[:1] == ["--"] else options.argv
    with working_container(IMAGE) as container:
        return subprocess.run(run_command(container, command)).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
