"""Build of fp4attn._C: the C CPU backend always, the CUDA backend when torch has CUDA and nvcc exists.

The C sources (csrc/cpu/*.c) are compiled here with the C compiler as C11 and linked in as
objects: torch's build rules would compile them as C++. CUDA sources get an explicit -gencode
list (FP4ATTN_CUDA_ARCHS) because torch's own arch detection drops the `a` suffix that wgmma
(sm_90a) and the block-scaled FP4 MMA (sm_120a) need.
"""

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("fp4attn_build_record",
                                               os.path.join(ROOT, "fp4attn", "_build_record.py"))
build_record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_record)
INCLUDE = os.path.join(ROOT, "csrc", "include")
DEFAULT_CUDA_ARCHS = "80;90a;120a"
C_FLAGS = ["-std=c11", "-O3", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-Wno-psabi"]
# FP4ATTN_SANITIZE=1: the C and C++ host code with AddressSanitizer and UBSan (maintainers:
# scripts/check_sanitizers.sh, which builds a fresh copy: an in-place build does not rebuild for a
# changed flag; the library then needs the sanitizer runtimes preloaded)
SANITIZE = os.environ.get("FP4ATTN_SANITIZE", "0") == "1"
SANITIZE_FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                  "-fno-sanitize-recover=undefined"]
if SANITIZE:
    C_FLAGS = [f for f in C_FLAGS if f != "-O3"] + SANITIZE_FLAGS


def cuda_archs():
    """FP4ATTN_CUDA_ARCHS as a list of nvcc architectures (80, 90a, 120a, ...), checked: the kernels
    need sm_80 or newer (cp.async, mma.sync on BF16)."""
    given = os.environ.get("FP4ATTN_CUDA_ARCHS", DEFAULT_CUDA_ARCHS)
    archs = [a.strip() for a in given.replace(",", ";").split(";") if a.strip()]
    bad = [a for a in archs if not re.fullmatch(r"\d{2,3}[af]?", a) or int(a.rstrip("af")) < 80]
    if not archs or bad:
        raise SystemExit(f"FP4ATTN_CUDA_ARCHS={given!r}: expected nvcc architectures >= 80 "
                         "separated by ';' (e.g. '80;90a;120a', the default, or '90a'), not "
                         f"{bad or given!r}")
    return archs


def gencode_flags(archs):
    flags = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    # PTX of the lowest architecture so newer GPUs without SASS here can still JIT.
    lowest = min(archs, key=lambda a: int(a.rstrip("af")))
    flags += ["-gencode", f"arch=compute_{lowest},code=compute_{lowest}"]
    return flags


def want_cuda():
    force_cpu = os.environ.get("FP4ATTN_FORCE_CPU", "0").strip().lower()
    if force_cpu in ("1", "true", "yes", "on"):
        return False, f"FP4ATTN_FORCE_CPU={force_cpu}"
    if force_cpu not in ("", "0", "false", "no", "off"):
        raise SystemExit(f"FP4ATTN_FORCE_CPU={force_cpu!r}: expected 1 / true / yes / on or "
                         "0 / false / no / off")
    if torch.version.cuda is None:
        return False, "this torch has no CUDA support"
    if CUDA_HOME is None:
        return False, "torch has CUDA but no CUDA toolkit was found: set CUDA_HOME to one with nvcc"
    if shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc")) is None:
        nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
        return False, f"torch has CUDA but {nvcc} does not exist: set CUDA_HOME to a CUDA " \
                      "toolkit with nvcc"
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
        c_sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.c")))
        if not c_sources:
            raise SystemExit(f"fp4attn: no C sources in {os.path.join(ROOT, 'csrc', 'cpu')}: an "
                             "incomplete source tree (an sdist built without MANIFEST.in?)")
        for src in c_sources:
            obj = os.path.join(out_dir, os.path.basename(src) + ".o")
            cmd = [cc, *C_FLAGS, *omp, "-I", INCLUDE, "-c", src, "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        for ext in self.extensions:
            ext.extra_objects = objects + list(ext.extra_objects or [])
            ext.extra_link_args = list(ext.extra_link_args or []) + omp + \
                (["-fsanitize=address,undefined"] if SANITIZE else [])
        super().build_extensions()

    def run(self):
        digest = build_record.sources_digest(ROOT, USE_CUDA)  # before: edits during the build
        super().run()  # builds in the build folder, then copies the library in place if asked
        # the record beside the library where it ends up (the source package for in-place and
        # editable builds, the build folder for a wheel)
        build_record.write(os.path.dirname(self.get_ext_fullpath("fp4attn._C")), digest,
                           BUILD_NOTE)


USE_CUDA, BUILD_NOTE = want_cuda()


def extension():
    sources = [os.path.join("csrc", "torch_bindings.cpp")]
    # -g0: Python's own CFLAGS carry -g, which made the library ~23x larger (debug info of torch's
    # headers); the CUDA sources keep -lineinfo for the profilers
    cxx_flags = ["-std=c++17"] + (SANITIZE_FLAGS if SANITIZE else ["-O3", "-g0"])
    if not USE_CUDA:
        print(f"fp4attn: building the CPU backend only ({BUILD_NOTE})", file=sys.stderr)
        return CppExtension("fp4attn._C", sources, include_dirs=[INCLUDE],
                            extra_compile_args={"cxx": cxx_flags})
    archs = cuda_archs()
    print(f"fp4attn: building CPU + CUDA backends ({BUILD_NOTE}); archs {archs}", file=sys.stderr)
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
    package_data={"fp4attn": ["py.typed"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildWithC},
)
