"""The build record beside fp4attn._C (fp4attn/_build_record.py): a source tree changed since
the build is reported before a call fails on a stale extension; the CLI's --version."""

import os
import subprocess
import sys

from fp4attn import _build_record as record


def _tree(tmp_path):
    (tmp_path / "csrc" / "cpu").mkdir(parents=True)
    (tmp_path / "csrc" / "include").mkdir()
    (tmp_path / "csrc" / "cuda").mkdir()
    (tmp_path / "csrc" / "torch_bindings.cpp").write_text("bindings")
    (tmp_path / "csrc" / "cpu" / "a.c").write_text("int a;")
    (tmp_path / "csrc" / "include" / "a.h").write_text("#define A")
    (tmp_path / "csrc" / "cuda" / "k.cu").write_text("kernel")
    (tmp_path / "setup.py").write_text("")
    package = tmp_path / "fp4attn"
    package.mkdir()
    return str(tmp_path), str(package)


def test_a_source_change_after_the_build_is_reported(tmp_path):
    root, package = _tree(tmp_path)
    record.write(package, record.sources_digest(root, cuda=False), "this torch has no CUDA support")
    assert record.read(package)["note"] == "this torch has no CUDA support"
    assert record.stale_note(package, cuda=False, record=record.read(package)) is None
    (tmp_path / "csrc" / "cuda" / "k.cu").write_text("kernel 2")  # not in a CPU-only build
    assert record.stale_note(package, cuda=False, record=record.read(package)) is None
    (tmp_path / "csrc" / "cpu" / "a.c~").write_text("an editor's backup")  # not a source
    assert record.stale_note(package, cuda=False, record=record.read(package)) is None
    (tmp_path / "csrc" / "include" / "a.h").write_text("#define A 2")
    note = record.stale_note(package, cuda=False, record=record.read(package))
    assert note and "rebuild it with `pip install --no-build-isolation -e .`" in note


def test_a_cuda_build_covers_the_cuda_sources(tmp_path):
    root, package = _tree(tmp_path)
    record.write(package, record.sources_digest(root, cuda=True), "")
    (tmp_path / "csrc" / "cuda" / "k.cu").write_text("kernel 2")
    assert record.stale_note(package, cuda=True, record=record.read(package))


def test_no_record_or_no_source_tree_is_not_reported(tmp_path):
    root, package = _tree(tmp_path)
    assert record.read(package) == {} and record.stale_note(package, cuda=False, record=record.read(package)) is None
    record.write(package, record.sources_digest(root, cuda=False), "")
    (tmp_path / "csrc" / "cpu" / "a.c").unlink()
    os.rename(tmp_path / "csrc", tmp_path / "elsewhere")  # an installed wheel: no csrc/ beside it
    assert record.stale_note(package, cuda=False, record=record.read(package)) is None


def test_cli_version():
    import fp4attn

    out = subprocess.run([sys.executable, "-m", "fp4attn", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"fp4attn {fp4attn.__version__}"
