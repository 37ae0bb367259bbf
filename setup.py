"""Build of fp4attn._C: the C CPU backend always, the CUDA backend when torch has CUDA and nvcc exists.

The C sources (csrc/cpu/*.c) are compiled here with the C compiler as C11 and linked in as
objects: torch's build rules would compile them as C++. CUDA sources get an explicit -gencode
list (FP4ATTN_CUDA_ARCHS) because torch's own arch detection drops the `a` suffix that wgmma
(sm_90a) and the block-scaled FP4 MMA (sm_120a) need.
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
INCLUDE = os.path.join(ROOT, "csrc", "include")
DEFAULT_CUDA_ARCHS = "80;90a;120a"
C_FLAGS = ["-std=c11", "-O3", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-Wno-psabi"]


def cuda_archs():
    archs = os.environ.get("FP4ATTN_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)
    return [a.strip() for a in archs.replace(",", ";").split(";") if a.strip()]


def gencode_flags(archs):
    flags = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    # PTX of the lowest architecture so newer GPUs without SASS here can still JIT.
    lowest = min(archs, key=lambda a: int(a.rstrip("af")))
    flags += ["-gencode", f"arch=compute_{lowest},code=compute_{lowest}"]
    return flags


def want_cuda():
    if os.environ.get("FP4ATTN_FORCE_CPU", "0") == "1":
        return False, "FP4ATTN_FORCE_CPU=1"
    if torch.version.cuda is None:
        return False, "this torch has no CUDA support"
    if CUDA_HOME is None or shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc")) is None:
        return False, "nvcc was not found (set CUDA_HOME)"
    return True, f"torch CUDA {torch.version.cuda}, nvcc in {CUDA_HOME}"


def openmp_flag():
    """-fopenmp if the C compiler accepts it (gcc does; some clang installs do not)."""
    cc = os.environ.get("CC", "cc")
    probe = subprocess.run(
        [cc, "-fopenmp", "-x", "c", "-", "-o", os.devnull],
        input=b"#include <omp.h>\nint main(void){return omp_get_max_threads() < 0;}\n",
        capture_output=True,
    )
    return ["-fopenmp"] if probe.returncode == 0 else []


class BuildWithC(BuildExtension):
    """Compiles csrc/cpu/*.c with the C compiler as C11 and links the objects into fp4attn._C."""

    def build_extensions(self):
        cc = os.environ.get("CC", "cc")
        omp = openmp_flag()
        print(f"fp4attn: C CPU backend with {cc} {'with OpenMP' if omp else 'WITHOUT OpenMP'}")
        out_dir = os.path.join(self.build_temp, "fp4attn_cpu")
        os.makedirs(out_dir, exist_ok=True)
        objects = []
        for src in sorted(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.c"))):
            obj = os.path.join(out_dir, os.path.basename(src) + ".o")
            cmd = [cc, *C_FLAGS, *omp, "-I", INCLUDE, "-c", src, "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        for ext in self.extensions:
            ext.extra_objects = objects + list(ext.extra_objects or [])
            ext.extra_link_args = list(ext.extra_link_args or []) + omp
        super().build_extensions()


def extension():
    use_cuda, why = want_cuda()
    sources = [os.path.join("csrc", "torch_bindings.cpp")]
    cxx_flags = ["-O3", "-std=c++17"]
    if not use_cuda:
        print(f"fp4attn: building the CPU backend only ({why})", file=sys.stderr)
        return CppExtension("fp4attn._C", sources, include_dirs=[INCLUDE],
                            extra_compile_args={"cxx": cxx_flags})
    archs = cuda_archs()
    print(f"fp4attn: building CPU + CUDA backends ({why}); archs {archs}", file=sys.stderr)
    cu_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "**", "*.cu"), recursive=True))
    cu_sources += sorted(glob.glob(os.path.join("csrc", "testing", "*.cu")))
    nvcc_flags = ["-O3", "-std=c++17", "-lineinfo", "--expt-relaxed-constexpr",
                  "-Xptxas=-warn-spills", *gencode_flags(archs)]
    return CUDAExtension("fp4attn._C", sources + cu_sources, include_dirs=[INCLUDE],
                         define_macros=[("FP4ATTN_WITH_CUDA", "1"),
                                        ("FP4ATTN_CUDA_ARCHS", "_".join(archs))],
                         extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags})


setup(
    packages=find_packages(include=["fp4attn", "fp4attn.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildWithC},
)
