"""fp4attn.Policy: which precision each attention call site of a model computes in.

A call site is an integer: the layer index (transformers passes the attention module, whose
``layer_idx`` it is) or, for ``fp4attn.patch(policy=..., model=...)``, the position of the call
among the attention calls of one forward of ``model`` (the same number for transformers' decoders
and encoders, which call attention once per layer, in order). Precisions:

    "fp4"   fp4attn.sdpa(precision="fp4")   docs/SPEC.md, NVFP4
    "int8"  fp4attn.sdpa(precision="int8")  docs/SPEC_INT8.md
    "bf16"  torch's own SDPA in the input dtype (exact up to that dtype: the safe fallback)

A policy is plain data: ``to_json`` / ``from_json`` and ``save`` / ``load`` round-trip it, with
``meta`` (JSON values: what calibrated it, on what, with which result) carried along.
"""

from __future__ import annotations

import json
from pathlib import Path

from .sdpa import ORIGINAL_SDPA, sdpa

#: The precisions a call site can have, in no particular cost order (that is per device).
PRECISIONS = ("fp4", "int8", "bf16")
FORMAT = "fp4attn.Policy"
VERSION = 1


def _check_precision(p, what: str) -> str:
    if p not in PRECISIONS:
        raise ValueError(f"{what} must be one of {list(PRECISIONS)}, got {p!r}")
    return p


def _check_site(s, what: str) -> int:
    # bool is an int subclass: True as a layer index is surely a mistake
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
        raise ValueError(f"{what} must be a layer index (an int >= 0), got {s!r}")
    return s


class Policy:
    """Per call site precision.

    ``Policy(["fp4", "int8", "bf16"])`` (one entry per layer, index = layer),
    ``Policy({3: "bf16"}, default="fp4")`` (the listed layers, ``default`` elsewhere) or
    ``Policy(default="int8")`` (every site). ``num_layers``, where known (a list gives it), is the
    number of call sites of one forward: a site at or past it is an error, not the default, since
    it means the model calls attention more often than the policy was made for.
    """

    def __init__(self, layers=None, default: str = "fp4", *, num_layers: int | None = None,
                 meta: dict | None = None):
        self.default = _check_precision(default, "default")
        if layers is None:
            layers = {}
        elif isinstance(layers, (list, tuple)):
            if num_layers is not None and num_layers != len(layers):
                raise ValueError(f"num_layers={num_layers} but layers lists {len(layers)} sites")
            num_layers = len(layers)
            layers = dict(enumerate(layers))
        elif not isinstance(layers, dict):
            raise TypeError("layers must be a list of precisions (one per layer), a dict "
                            f"{{layer index: precision}} or None, got {type(layers).__name__}")
        self.layers = {_check_site(s, "layers key"): _check_precision(p, f"layers[{s}]")
                       for s, p in sorted(layers.items())}
        if num_layers is not None:
            _check_site(num_layers, "num_layers")
            bad = [s for s in self.layers if s >= num_layers]
            if bad:
                raise ValueError(f"layers {bad} are out of range for num_layers={num_layers}")
        self.num_layers = num_layers
        if meta is not None and not isinstance(meta, dict):
            raise TypeError(f"meta must be a dict or None, got {type(meta).__name__}")
        self.meta = dict(meta or {})
        json.dumps(self.meta)  # fails here, not at save time, if meta is not JSON data

    @classmethod
    def uniform(cls, precision: str) -> "Policy":
        """Every call site in ``precision``."""
        return cls(default=precision)

    @property
    def is_uniform(self) -> bool:
        """True when every site has the same precision (no site numbering needed)."""
        return all(p == self.default for p in self.layers.values())

    def precision(self, site: int | None) -> str:
        """The precision of call site ``site``; None (site unknown) only for a uniform policy."""
        if site is None:
            if not self.is_uniform:
                raise ValueError("this policy differs per layer, so it needs the call site "
                                 "(layer index); got none")
            return self.default
        _check_site(site, "site")
        if self.num_layers is not None and site >= self.num_layers:
            raise ValueError(f"attention call site {site} is past this policy's num_layers="
                             f"{self.num_layers}: the model calls attention more often per "
                             "forward than the policy was made for")
        return self.layers.get(site, self.default)

    def check_fits(self, config, *, by_layer_index: bool = False) -> None:
        """Refuses to number a model's attention calls with a per-layer policy where the numbers
        would be wrong: an encoder-decoder or a decoder with cross-attention (its encoder,
        decoder and cross-attention calls share layer indices, and generate runs decoder steps
        without the model's forward; a sub-model's config says so by add_cross_attention), and with
        ``by_layer_index`` (sites are the attention modules' ``layer_idx``) a transformers
        ``config`` whose ``num_hidden_layers`` differs from ``num_layers``. (Sites counted as
        the calls of one forward are checked by patch() after each forward: hybrid models have
        fewer attention calls than layers.) A uniform policy, or ``config`` None, fits any
        model."""
        if self.is_uniform or config is None:
            return
        if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention",
                                                                   False):
            raise ValueError("a per-layer policy numbers the attention calls of decoder-only or "
                             "encoder-only models; this one is an encoder-decoder or has "
                             "cross-attention (its self- and cross-attention calls share layer "
                             "indices): use a uniform policy or precision")
        n = getattr(config, "num_hidden_layers", None)
        if by_layer_index and isinstance(n, int) and self.num_layers is not None and \
                n != self.num_layers:
            raise ValueError(f"this policy has num_layers={self.num_layers}, the model "
                             f"{n} layers (config.num_hidden_layers): it was made for another model")

    def as_list(self) -> list[str]:
        """One precision per site (needs num_layers)."""
        if self.num_layers is None:
            raise ValueError("as_list needs num_layers (this policy does not know its size)")
        return [self.precision(i) for i in range(self.num_layers)]

    def fp4_share(self, weights: list[float]) -> float:
        """The share of ``weights`` (per site, e.g. attention FLOPs) computed in FP4."""
        total = float(sum(weights))
        if total <= 0:
            raise ValueError("weights must have a positive sum")
        return sum(w for i, w in enumerate(weights) if self.precision(i) == "fp4") / total

    # -- plain data -------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "default": self.default,
                "num_layers": self.num_layers,
                "layers": {str(s): p for s, p in self.layers.items()}, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "Policy":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not an {FORMAT} document (its 'format' must be {FORMAT!r})")
        if d.get("version") != VERSION:
            raise ValueError(f"{FORMAT} version {d.get('version')!r} is not supported "
                             f"(this fp4attn reads version {VERSION})")
        layers = d.get("layers", {})
        if not isinstance(layers, dict):
            raise ValueError("'layers' must be an object {\"layer index\": precision}")
        canonical = [s for s in layers if (isinstance(s, str) and s.isascii() and s.isdigit() and
                                           str(int(s)) == s)  # not " 3", "03", "1_0", "٣"
                     or (isinstance(s, int) and not isinstance(s, bool) and s >= 0)]
        if len(canonical) != len(layers):
            raise ValueError(f"'layers' keys must be layer indices written as decimal integers, "
                             f"got {list(layers)}")
        sites = {int(s): p for s, p in layers.items()}
        return cls(sites, d.get("default", "fp4"), num_layers=d.get("num_layers"),
                   meta=d.get("meta"))

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Policy":
        return cls.from_dict(json.loads(text))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path) -> "Policy":
        return cls.from_json(Path(path).read_text())

    def __eq__(self, other) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return (self.default, self.layers, self.num_layers, self.meta) == (
            other.default, other.layers, other.num_layers, other.meta)

    def code(self) -> str:
        """The policy as one character per site: "4" fp4, "8" int8, "b" bf16 (needs
        num_layers); ``Policy.from_code`` reads it back (without meta)."""
        return "".join(_CODE[p] for p in self.as_list())

    @classmethod
    def from_code(cls, code: str) -> "Policy":
        if not isinstance(code, str) or not code or set(code) - set(_PRECISION_OF):
            raise ValueError(f"code must be a non-empty string of {list(_PRECISION_OF)} (fp4, "
                             f"int8, bf16 per site), got {code!r}")
        return cls([_PRECISION_OF[c] for c in code])

    def __repr__(self) -> str:
        if self.num_layers is not None:
            return f"Policy({self.as_list()})"
        return f"Policy({self.layers}, default={self.default!r})"


_CODE = {"fp4": "4", "int8": "8", "bf16": "b"}
_PRECISION_OF = {c: p for p, c in _CODE.items()}


def attention(precision: str, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
              scale=None, enable_gqa=False):
    """torch SDPA's contract, computed in one of the policy precisions."""
    if precision == "bf16":
        kw = {"enable_gqa": True} if enable_gqa else {}  # older torch has no enable_gqa keyword
        return ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                             is_causal=is_causal, scale=scale, **kw)
    return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                scale=scale, enable_gqa=enable_gqa, precision=_check_precision(precision,
                                                                                "precision"))
