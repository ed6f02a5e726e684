"""The one header line every benchmark's results file starts with: machine, date, command and commit, so that a
figure read later says where, when, how and from which code it was measured."""

from __future__ import annotations

import datetime
import shlex
import subprocess
import sys
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parent.parent


def machine() -> str:
    """The CPU's model name, family and model and core count (lscpu: a VM's "AMD EPYC" alone does not tell Zen 4 from
    Zen 5), and the GPU's name where torch sees one."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        fields = {name.strip(): value.strip() for name, value in fields.items()}
        cpu = fields["Model name"]
        if "CPU family" in fields and "Model" in fields:
            cpu += f" (family {fields['CPU family']} model {fields['Model']})"
        if "CPU(s)" in fields:
            cpu += f", {fields['CPU(s)']} CPUs"
    except (OSError, subprocess.SubprocessError, KeyError):
        import platform

        cpu = platform.processor() or platform.machine()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return f"{cpu}, {torch.cuda.get_device_name()}"
    return cpu


def commit() -> str:
    """`git rev-parse --short HEAD` of this checkout, "+dirty" when its tree has changes; "unknown (no git
    checkout)" where there is none (the GPU kit's copy)."""
    def git(*arguments: str) -> str:
        return subprocess.run(["git", "-C", str(REPOSITORY), *arguments], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git checkout)"


def script_command() -> str:
    """The command that ran this process, as retyped in its working directory (`python` before a .py script; the
    GPU kit's `kit/run` as it is)."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(Path.cwd()) if script.is_relative_to(Path.cwd()) else script
    return ("python " if script.suffix == ".py" else "") + shlex.join([str(shown), *sys.argv[1:]])


def header(command: str | None = None) -> str:
    """One line: machine, date (UTC), command (default: this process's) and commit."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"Machine: {machine()}; date: {date}; command: `{command or script_command()}`; "
            f"commit: {commit()}")


def publish(text: str, out: str | None) -> None:
    """Print a script's results and, where `out` names a file (its --out), write them there too."""
    print(text)
    if out:
        with open(out, "w") as file:
            file.write(text)
