"""Variable-length attention on packed sequences, with the interface of torch's
torch.nn.attention.varlen.varlen_attn (FlashAttention's varlen form): query [Tq, Hq, D] and key /
value [Tk, Hkv, D] hold a batch of sequences back to back, cu_seq_q / cu_seq_k ([N + 1] integers)
where each starts. Each sequence runs as its own fp4attn.sdpa call, so the result is bit for bit
that call's: no quantization block spans two sequences, and a sequence's result does not depend
on the others in the batch.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import Tensor

from .sdpa import _autocast_dtype, _sequence_call


def _integers(name: str, t, what: str) -> list[int]:
    """A 1-D integer tensor's values on the host."""
    if not isinstance(t, Tensor) or t.dim() != 1 or t.is_floating_point() or t.is_complex() or \
            t.dtype == torch.bool:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 1-D integer tensor of {what}, got {got}")
    return t.tolist()


def _short(values: list[int]) -> list:
    return values if len(values) <= 8 else values[:4] + ["..."] + values[-2:]


def _offsets(name: str, cu: Tensor, total: int, cover: bool) -> list[int]:
    """cu's values on the host, checked: non-decreasing from 0, to `total` (cover: every row of
    the tensor belongs to a sequence) or at most `total`."""
    offsets = _integers(name, cu, "N + 1 sequence starts")
    if not offsets or offsets[0] != 0 or offsets[-1] > total or (cover and offsets[-1] != total) \
            or any(b < a for a, b in pairwise(offsets)):
        bound = f"to the {total} rows" if cover else f"to at most the {total} rows"
        raise ValueError(f"{name} must rise from 0 {bound} of its tensor, got {_short(offsets)}")
    return offsets


def _length(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int, got {n!r}")
    return n


def _is_causal(window_size, max_q: int, max_k: int) -> bool:
    """FlashAttention's (left, right) window as full attention (False) or causal (True): a side
    that is negative or reaches past every key (left >= max_k, right >= max_q with the queries
    aligned to the last keys) is unbounded. Other windows raise."""
    window = tuple(window_size)
    if len(window) == 2 and all(isinstance(w, int) and not isinstance(w, bool) for w in window):
        left, right = window
        if left < 0 or left >= max_k:
            if right < 0 or right >= max_q:
                return False
            if right == 0:
                return True
    raise ValueError(f"window_size must be full attention (-1, -1) or causal (-1, 0), got "
                     f"{window_size}: sliding windows are not supported by fp4attn.varlen_attn")


def varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor,
                max_q: int, max_k: int, *, return_aux=None, scale: float | None = None,
                window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                seqused_k: Tensor | None = None, block_table: Tensor | None = None,
                num_splits: int | None = None, precision: str = "fp4",
                strict: bool | None = None):
    """Low-bit attention over packed variable-length sequences, with the arguments of
    torch.nn.attention.varlen.varlen_attn.

    query [Tq, Hq, D], key and value [Tk, Hkv, D]; sequence i is rows cu_seq_q[i]:cu_seq_q[i + 1]
    of query and cu_seq_k[i]:cu_seq_k[i + 1] of key and value (the query's starts must cover it: 0
    first, its row count last; keys after the last sequence are not used). max_q and max_k bound
    the sequences' lengths (checked). window_size (-1, -1) is full attention, (-1, 0) causal as
    FlashAttention aligns it: a sequence's last query sees all its keys (top-left and bottom-right
    agree where the lengths are equal; queries before the first key see none and give zeros).
    seqused_k[i] keys of sequence i take part (the first ones). return_aux with .lse true also
    returns the lse, float32 [Hq, Tq] as torch's varlen op lays it out; a row that sees no key has
    lse -inf, as in fp4attn.sdpa (FlashAttention writes +inf). num_splits is accepted for
    compatibility: the results never depend on the batch's other sequences (what num_splits=1 asks
    of torch's kernel). precision and strict are fp4attn.sdpa's (a value head dim other than D
    falls back as there); precision="int8" gives query, key and value their gradients. Sliding
    windows and paged keys (block_table: see FP4KVCache) raise. Each sequence is one fp4attn.sdpa
    call on dense views: the host reads the starts, and many short sequences cost a launch
    sequence each.
    """
    if block_table is not None:
        raise ValueError("block_table (a paged key / value pool) is not supported by "
                         "fp4attn.varlen_attn: fp4attn's paged cache is fp4attn.FP4KVCache "
                         "(decode / decode_paged)")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a [total, heads, head_dim] tensor, got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(f"key and value must have the same rows and heads, got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    hq, hkv = query.shape[1], key.shape[1]
    if (hq != hkv and not enable_gqa) or (enable_gqa and (hkv == 0 or hq % hkv != 0)):
        raise ValueError(f"query has {hq} heads and key / value {hkv}: equal, or with "
                         f"enable_gqa=True a multiple")
    if key.shape[2] != query.shape[2] or not (query.dtype == key.dtype == value.dtype) or \
            not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must share their dtype and device and query and "
                         f"key their head dim, got {query.dtype} / {key.dtype} / {value.dtype} on "
                         f"{query.device} / {key.device} / {value.device}, head dims "
                         f"{query.shape[2]} and {key.shape[2]}")
    if cu_seq_k is None:
        raise ValueError("cu_seq_k is required (torch allows None only with block_table)")
    max_q, max_k = _length("max_q", max_q), _length("max_k", max_k)
    causal = _is_causal(window_size, max_q, max_k)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 0):
        raise ValueError(f"num_splits must be None or an int >= 0, got {num_splits!r}")
    q_off = _offsets("cu_seq_q", cu_seq_q, query.shape[0], cover=True)
    k_off = _offsets("cu_seq_k", cu_seq_k, key.shape[0], cover=False)
    if len(q_off) != len(k_off):
        raise ValueError(f"cu_seq_q and cu_seq_k must describe the same number of sequences, got "
                         f"{len(q_off) - 1} and {len(k_off) - 1}")
    q_len = [b - a for a, b in pairwise(q_off)]
    k_len = [b - a for a, b in pairwise(k_off)]
    if seqused_k is not None:
        used = _integers("seqused_k", seqused_k, "N key counts")
        if len(used) != len(k_len) or any(not 0 <= u <= n for u, n in zip(used, k_len)):
            raise ValueError(f"seqused_k must give each of the {len(k_len)} sequences between 0 "
                             f"and its {_short(k_len)} keys, got {_short(used)}")
        k_len = used
    if q_len and (max(q_len) > max_q or max(k_len) > max_k):
        raise ValueError(f"max_q and max_k must bound the sequences' lengths: the longest are "
                         f"{max(q_len)} queries and {max(k_len)} keys, got max_q={max_q}, "
                         f"max_k={max_k}")
    want_lse = return_aux is not None and bool(getattr(return_aux, "lse", False))
    dtype = _autocast_dtype(query)  # of the outputs, as the calls give it
    heads, dv = query.shape[1], value.shape[-1]
    outs = [query.new_empty((0, heads, dv), dtype=dtype)]  # [n_i, Hq, Dv] each
    lses = [query.new_empty((heads, 0), dtype=torch.float32)]  # [Hq, n_i] each
    for qa, nq, ka, nk in zip(q_off, q_len, k_off, k_len):
        q = query[qa:qa + nq].transpose(0, 1)[None]  # [1, Hq, nq, D], a view
        k = key[ka:ka + nk].transpose(0, 1)[None]
        v = value[ka:ka + nk].transpose(0, 1)[None]
        mask, is_causal = None, causal
        if causal and nq != nk and nq and nk:  # FlashAttention's: the queries are the last positions
            mask = torch.ones(nq, nk, dtype=torch.bool, device=query.device).tril(nk - nq)
            is_causal = False
        out, lse = _sequence_call(q, k, v, mask, 0.0, is_causal, scale, enable_gqa, precision,
                                  want_lse, strict, dtype)
        outs.append(out[0].transpose(0, 1))
        lses.append(None if lse is None else lse[0])
    out = torch.cat(outs, dim=0)  # [Tq, Hq, Dv], contiguous
    if not want_lse:
        return out
    return out, torch.cat(lses, dim=1)
