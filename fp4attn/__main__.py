"""python -m fp4attn {info,demo,report} ..."""

from __future__ import annotations

import argparse
import platform
import sys

import torch


_KERNEL_TEXT = {
    "sm80": "sm80 (mma.sync, exact FP16/BF16 dequantization)",
    "sm90": "sm90 (wgmma + TMA)",
    "sm120": "sm120 (block-scaled FP4 MMA)",
}
# The 8-bit attention's kernels (forward and backward: the backward on sm90 for head dims up to
# 128, on mma.sync otherwise).
_INT8_KERNEL_TEXT = {
    "sm80": "sm80 (INT8 mma.sync)",
    "sm90": "sm90 (INT8 wgmma + TMA)",
}


def info(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="python -m fp4attn info",
                            description="backends compiled, architectures, versions").parse_args(argv)
    from . import __version__, build_info
    from ._ops import attention_kernel

    b = build_info()
    print(f"fp4attn {__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"CPU backend: C11, OpenMP {'on' if b['openmp'] else 'off'}, "
          f"{torch.get_num_threads()} threads")
    if b["cuda"]:
        print(f"CUDA backend: compiled for {b['cuda_archs'].replace('_', ', ')}")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"  cuda:{i} {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
            for precision, texts in (("fp4", _KERNEL_TEXT), ("int8", _INT8_KERNEL_TEXT)):
                chosen = ", ".join(
                    f"D<={d}: {texts.get(attention_kernel(i, d, precision), 'none')}"
                    for d in (64, 128, 256))
                print(f"    {precision:4s} -> {chosen}")
    else:
        reason = f": {b['note']}" if b.get("note") else ""
        print(f"CUDA backend: not compiled (CPU-only build{reason})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--version"]:
        from . import __version__

        print(f"fp4attn {__version__}")
        return 0
    commands = {"info": info}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("info", "demo", "report"):
        print("usage: python -m fp4attn {info,demo,report} [options] | --version\n"
              "  info    backends compiled, architectures, versions\n"
              "  demo    FP4 attention vs exact attention and FP16 SDPA, with timings\n"
              "  report  accuracy on real models: FP4, INT8 and a calibrated per-layer policy\n"
              "          side by side (see --help)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv[0] == "report":
        from .eval.report import main as report_main

        return report_main(argv[1:])
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
