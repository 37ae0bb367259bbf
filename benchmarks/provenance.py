"""The header every benchmark result carries: the exact command, the hardware and the software.

A result CSV starts with `# key: value` lines (command, hardware, software, date) and then the
CSV proper; readers skip the `#` lines (pandas: `read_csv(path, comment="#")`). Running the
command in the header from the repository root regenerates the result set.
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import shlex
import subprocess
import sys

import torch

import fp4attn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Environment variables that change what a run measures; they are part of its command line.
RUN_ENV = ("FP4ATTN_KERNEL", "FP4ATTN_STRICT", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")


def command_line() -> str:
    """The command as typed from the repository root, with the environment that matters."""
    script = os.path.abspath(sys.argv[0])
    if script.startswith(ROOT + os.sep):
        script = os.path.relpath(script, ROOT)
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in RUN_ENV if k in os.environ]
    return " ".join(env + ["python", shlex.join([script, *sys.argv[1:]])])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_description() -> str:
    return f"{cpu_name()}, {os.cpu_count()} logical CPUs, torch threads {torch.get_num_threads()}"


def gpu_description(device: int = 0) -> str:
    p = torch.cuda.get_device_properties(device)
    return (f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
            f"{p.total_memory / 2**30:.0f} GiB)")


def git_commit() -> str:
    """HEAD of the checkout fp4attn is imported from, `+changes` when tracked files differ; the
    environment's FP4ATTN_GIT_COMMIT instead where the tree was copied without its history (a
    lent GPU machine), so that the header names the code that really ran."""
    if os.environ.get("FP4ATTN_GIT_COMMIT"):
        return os.environ["FP4ATTN_GIT_COMMIT"]
    src = os.path.dirname(os.path.dirname(os.path.abspath(fp4attn.__file__)))
    try:
        head = subprocess.run(["git", "-C", src, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" +changes" if dirty else "")


def _versions() -> str:
    """What else decides a torch baseline's or a model's numbers: cuDNN (torch's cuDNN SDPA), the
    driver, and the packages some benchmarks import (those not installed are left out)."""
    import importlib.metadata as md

    out = []
    if torch.cuda.is_available():
        out.append(f"cuDNN {torch.backends.cudnn.version()}")
        try:
            drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, check=True).stdout.split()
            out.append(f"driver {drv[0]}" if drv else "driver unknown")
        except (OSError, subprocess.CalledProcessError):
            out.append("driver unknown")
    for pkg in ("transformers", "sageattention", "triton"):
        try:
            out.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            pass
    return ", ".join(out)


def software_description() -> str:
    b = fp4attn.build_info()
    backends = f"CUDA archs {b['cuda_archs'] or '-'}" if b["cuda"] else "CPU-only build"
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    extra = _versions()
    return (f"torch {torch.__version__} ({cuda}), python "
            f"{platform.python_version()}; fp4attn {fp4attn.__version__} git {git_commit()}, "
            f"{backends}, OpenMP {'on' if b['openmp'] else 'off'}" + (f"; {extra}" if extra else ""))


def header(hardware: str) -> dict[str, str]:
    return {
        "command": command_line(),
        "hardware": hardware,
        "software": software_description(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def announce(hardware: str) -> dict[str, str]:
    """header(hardware), printed as the run starts."""
    head = header(hardware)
    for k, v in head.items():
        print(f"{k}: {v}")
    return head


def print_table(columns: list[str], body: list[list[str]]) -> None:
    """A Markdown table of preformatted cells."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for cells in body:
        print("| " + " | ".join(cells) + " |")


def write_csv(path: str, head: dict[str, str], rows: list[dict]) -> None:
    """`# key: value` header lines, then the rows as CSV."""
    with open(path, "w", newline="") as f:
        for k, v in head.items():
            f.write(f"# {k}: {v}\n")
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def read_csv(path: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(header, rows) of a file written by write_csv; a file without header gives {}."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    head = dict(line[2:].split(": ", 1) for line in lines if line.startswith("# ") and ": " in line)
    return head, list(csv.DictReader(line for line in lines if not line.startswith("#")))
