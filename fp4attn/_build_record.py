"""What a build of fp4attn._C was made from, written beside it by setup.py (_C_build.json): the
sources' digest and why the CUDA backend was or was not built. In a source tree (an editable
install) the digest tells a stale extension -- csrc/ changed since the build, e.g. after a
`git pull` -- before a call fails with an argument-count error. No imports of torch or fp4attn:
setup.py loads this file by path."""

from __future__ import annotations

import glob
import hashlib
import json
import os

RECORD = "_C_build.json"


SOURCE_SUFFIXES = (".c", ".h", ".cpp", ".cu", ".cuh")


def build_sources(root: str, cuda: bool) -> list[str]:
    """The sources under root/csrc that a build reads (a CPU-only build reads no CUDA source);
    other files there (editor backups, patches) do not count."""
    csrc = os.path.join(root, "csrc")
    if cuda:
        files = glob.glob(os.path.join(csrc, "**", "*"), recursive=True)
    else:
        files = [os.path.join(csrc, "torch_bindings.cpp")]
        for sub in ("cpu", "include"):
            files += glob.glob(os.path.join(csrc, sub, "**", "*"), recursive=True)
    return sorted(f for f in files if f.endswith(SOURCE_SUFFIXES) and os.path.isfile(f))


def sources_digest(root: str, cuda: bool) -> str:
    h = hashlib.sha256()
    for path in build_sources(root, cuda):
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def write(package_dir: str, digest: str, note: str) -> None:
    """The record of a build from sources whose digest (sources_digest) was taken before it."""
    with open(os.path.join(package_dir, RECORD), "w") as f:
        json.dump({"sources_sha256": digest, "note": note}, f)


def read(package_dir: str) -> dict:
    """The record beside the extension, {} without one (a build by other means)."""
    try:
        with open(os.path.join(package_dir, RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def stale_note(package_dir: str, cuda: bool, record: dict) -> str | None:
    """A message if this package sits in a source tree whose csrc/ differs from what its extension
    was built from (`record`, as read); None otherwise (an installed wheel has no csrc/ beside
    it)."""
    root = os.path.dirname(os.path.abspath(package_dir))
    recorded = record.get("sources_sha256")
    if recorded is None or not (os.path.isdir(os.path.join(root, "csrc")) and
                                os.path.isfile(os.path.join(root, "setup.py"))):
        return None  # not a source tree of fp4attn
    if sources_digest(root, cuda) == recorded:
        return None
    return (f"fp4attn._C was built from other sources than {os.path.join(root, 'csrc')} holds now "
            "(changed since the build): rebuild it with `pip install --no-build-isolation -e .` "
            "(or `python setup.py build_ext --inplace`); until then calls may fail or run old code")
