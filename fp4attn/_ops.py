"""Loads the compiled backends (fp4attn._C) and registers fake (meta) implementations.

The fake implementations describe output shapes and dtypes without computing, which is what
torch.compile(fullgraph=True), torch.export and FakeTensor tracing need.
"""

import functools
import inspect
import os
import warnings

import torch

from . import _build_record

try:
    from . import _C  # noqa: F401  (registers torch.ops.fp4attn.*)
except ImportError as exc:  # pragma: no cover - only when the extension was not built
    raise ImportError(
        "fp4attn's compiled extension (fp4attn._C) is missing or broken: build it with "
        "`pip install --no-build-isolation -e .` in the repository root (or reinstall fp4attn)"
    ) from exc

ops = torch.ops.fp4attn
BLOCK = 16


# Read once at import: a pybind call inside sdpa() would break torch.compile(fullgraph=True).
_BUILD_INFO = dict(_C.build_info())
HAS_CUDA_BACKEND = bool(_BUILD_INFO["cuda"])
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
#: why the build has or lacks its CUDA backend ("" for a build by other means than setup.py)
_record = _build_record.read(_PACKAGE_DIR)
_BUILD_INFO["note"] = _record.get("note", "")
_stale = _build_record.stale_note(_PACKAGE_DIR, HAS_CUDA_BACKEND, _record)
if _stale:
    warnings.warn(_stale, stacklevel=2)


def build_info() -> dict:
    """Which backends this build of fp4attn._C contains."""
    return dict(_BUILD_INFO)


def attention_kernel(device: int, head_dim: int, precision: str = "fp4") -> str:
    """The CUDA kernel the dispatch chooses for a prefill of `head_dim` on CUDA device `device`
    ("sm80", "sm90", "sm120", or "none" where no kernel can run), for the FP4 attention or
    (precision="int8") the 8-bit attention's forward; "none" on a build without CUDA."""
    if precision not in ("fp4", "int8"):
        raise ValueError(f"precision must be 'fp4' or 'int8', got {precision!r}")
    return _C.attention_kernel(int(device), int(head_dim), precision == "int8")


def code_bytes(cols: int) -> int:
    return (cols + BLOCK - 1) // BLOCK * (BLOCK // 2)


def scale_count(cols: int) -> int:
    return (cols + BLOCK - 1) // BLOCK


def _check_one_device(op: str, arguments: dict) -> None:
    named = [(name, t) for name, t in arguments.items() if isinstance(t, torch.Tensor)]
    first, device = named[0][0], named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise RuntimeError(f"fp4attn.{op}: {name} is on {t.device} but {first} on {device}: "
                               f"all tensors must be on one device")


def register_fake(op: str):
    """torch.library.register_fake for fp4attn::op, with the device check the real kernels make:
    the dispatcher runs a fake (Meta) kernel whenever one argument is a meta tensor, so a call
    mixing meta and real tensors would otherwise return uninitialized memory as its result."""
    def register(fake):
        signature = inspect.signature(fake)

        @functools.wraps(fake)
        def checked(*args, **kwargs):
            _check_one_device(op, signature.bind(*args, **kwargs).arguments)
            return fake(*args, **kwargs)

        return torch.library.register_fake(f"fp4attn::{op}")(checked)
    return register


@register_fake("quantize")
def _quantize_fake(x):
    lead, rows, cols = x.shape[:-2], x.shape[-2], x.shape[-1]
    return (
        x.new_empty((*lead, rows, code_bytes(cols)), dtype=torch.uint8),
        x.new_empty((*lead, rows, scale_count(cols)), dtype=torch.uint8),
        x.new_empty(lead, dtype=torch.float32),
    )


@register_fake("dequantize")
def _dequantize_fake(codes, scales, dec, cols):
    return codes.new_empty((*codes.shape[:-1], cols), dtype=torch.float32)


@register_fake("fp4mm")
def _fp4mm_fake(a_codes, a_scales, a_dec, b_codes, b_scales, b_dec, k, out_dtype):
    lead = a_codes.shape[:-2] if a_dec.numel() >= b_dec.numel() else b_codes.shape[:-2]
    return a_codes.new_empty((*lead, a_codes.shape[-2], b_codes.shape[-2]), dtype=out_dtype)


@register_fake("attention")
def _attention_fake(q, k, v, attn_mask, is_causal, scale, return_lse, cuda_kernel="auto"):
    out = q.new_empty(q.shape)  # contiguous, like the real op
    lse_shape = q.shape[:-1] if return_lse else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@register_fake("kv_append")
def _kv_append_fake(k, v, k_codes, k_scales, k_exp, v_codes, v_scales, v_dec, kmean, kscale,
                    block_table, start, set_mean, mean_from=None, mean_rows=0):
    return None


@register_fake("decode")
def _decode_fake(q, k_codes, k_scales, k_exp, v_codes, v_scales, v_dec, kmean, kscale,
                 block_table, seq_lens, scale, window=0, res_k=None, res_v=None, residual_len=0,
                 key_start=None):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)
