"""Loads the compiled backends (fp4attn._C) and registers fake (meta) implementations.

The fake implementations describe output shapes and dtypes without computing, which is what
torch.compile(fullgraph=True), torch.export and FakeTensor tracing need.
"""

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


def check_one_device(op: str, **tensors) -> None:
    """The fake kernels' device check: the dispatcher runs them (Meta) whenever one argument is a
    meta tensor, so a call mixing meta and real tensors would return uninitialized memory as the
    result; the real kernels check the same."""
    named = [(name, t) for name, t in tensors.items() if isinstance(t, torch.Tensor)]
    first, device = named[0][0], named[0][1].device
    for name, t in named[1:]:
        if t.device != device:
            raise RuntimeError(f"fp4attn.{op}: {name} is on {t.device} but {first} on {device}: "
                               f"all tensors must be on one device")


@torch.library.register_fake("fp4attn::quantize")
def _quantize_fake(x):
    lead, rows, cols = x.shape[:-2], x.shape[-2], x.shape[-1]
    return (
        x.new_empty((*lead, rows, code_bytes(cols)), dtype=torch.uint8),
        x.new_empty((*lead, rows, scale_count(cols)), dtype=torch.uint8),
        x.new_empty(lead, dtype=torch.float32),
    )


@torch.library.register_fake("fp4attn::dequantize")
def _dequantize_fake(codes, scales, dec, cols):
    check_one_device("dequantize", codes=codes, scales=scales, dec=dec)
    return codes.new_empty((*codes.shape[:-1], cols), dtype=torch.float32)


@torch.library.register_fake("fp4attn::fp4mm")
def _fp4mm_fake(a_codes, a_scales, a_dec, b_codes, b_scales, b_dec, k, out_dtype):
    check_one_device("fp4mm", a_codes=a_codes, a_scales=a_scales, a_dec=a_dec, b_codes=b_codes,
                     b_scales=b_scales, b_dec=b_dec)
    lead = a_codes.shape[:-2] if a_dec.numel() >= b_dec.numel() else b_codes.shape[:-2]
    return a_codes.new_empty((*lead, a_codes.shape[-2], b_codes.shape[-2]), dtype=out_dtype)


@torch.library.register_fake("fp4attn::attention")
def _attention_fake(q, k, v, attn_mask, is_causal, scale, return_lse, cuda_kernel="auto"):
    check_one_device("attention", q=q, k=k, v=v, attn_mask=attn_mask)
    out = q.new_empty(q.shape)  # contiguous, like the real op
    lse_shape = q.shape[:-1] if return_lse else (0,)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.register_fake("fp4attn::kv_append")
def _kv_append_fake(k, v, k_codes, k_scales, k_exp, v_codes, v_scales, v_dec, kmean, kscale,
                    block_table, start, set_mean, mean_from=None, mean_rows=0):
    check_one_device("kv_append", k=k, v=v, k_codes=k_codes, k_scales=k_scales, k_exp=k_exp,
                     v_codes=v_codes, v_scales=v_scales, v_dec=v_dec, kmean=kmean, kscale=kscale,
                     block_table=block_table, mean_from=mean_from)
    return None


@torch.library.register_fake("fp4attn::decode")
def _decode_fake(q, k_codes, k_scales, k_exp, v_codes, v_scales, v_dec, kmean, kscale,
                 block_table, seq_lens, scale, window=0, res_k=None, res_v=None, residual_len=0,
                 key_start=None):
    check_one_device("decode", q=q, k_codes=k_codes, k_scales=k_scales, k_exp=k_exp,
                     v_codes=v_codes, v_scales=v_scales, v_dec=v_dec, kmean=kmean, kscale=kscale,
                     block_table=block_table, seq_lens=seq_lens, res_k=res_k, res_v=res_v,
                     key_start=key_start)
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)
