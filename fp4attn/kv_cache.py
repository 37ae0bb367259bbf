"""The FP4 KV cache and decode attention on it (docs/SPEC.md section 6).

    cache = fp4attn.FP4KVCache(batch, kv_heads, head_dim, dtype=torch.float16, device="cuda")
    cache.append(k, v)                 # [B, Hkv, n, D]: quantized once, here
    out = fp4attn.decode(q, cache)     # q [B, Hq, nq, D]: the last nq positions

Keys are stored as rotated 5-bit rows (K minus its mean over the first 128 tokens, each channel
divided by a scale fixed on the same tokens (the square root of its largest magnitude; queries are
multiplied by it), Hadamard-rotated, integer codes -15..15 with an E4M3 scale per 64 values and a
power-of-two row scale), values as
NVFP4 rows (an E4M3 scale per 16 values, one FP32 scale per row): 159 bytes per token and head at
head dim 128. Each query reads its newest ``residual_length`` (16) keys and values exactly, from a
small ring beside the pages (KIVI's residual): 3.21x less memory than FP16 at 32K tokens, all of
it counted. Pages of fixed size with a block table (the vLLM /
FlashInfer convention): `fp4attn.decode_paged` takes the pages, a table and per-sequence lengths
directly, for serving engines and ragged batches. The math of the decode is not quantized
(FP16/BF16 tensor cores or FP32 with FP32 accumulation); only the cache is.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor

from . import reference
from ._ops import code_bytes, scale_count

__all__ = ["FP4KVCache", "decode", "decode_paged"]

#: Tokens per page when the constructor is not told.
DEFAULT_PAGE_SIZE = 128
#: Most query positions one decode call serves (speculative decoding); a windowed cache keeps
#: the last window + MAX_DECODE_QUERIES - 1 tokens, all that such calls can read.
MAX_DECODE_QUERIES = 16
#: Newest keys and values each query reads exactly (SPEC 6's residual), when not told.
DEFAULT_RESIDUAL = 16
#: Tokens whose K mean and channel scales smooth the keys (SPEC 6): the first KMEAN_TOKENS stored,
#: whatever the appends' lengths; until that many are stored, every append stores them all again,
#: exactly, with the mean and scales of those stored so far.
KMEAN_TOKENS = 128
#: Most stored tokens kept as exact copies while K's statistics are open (a padded batch whose
#: sequences lack tokens after their padding): past it they are fixed with the tokens they have.
EARLY_TOKENS = 2 * KMEAN_TOKENS
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class FP4KVCache:
    """A KV cache of ``batch`` sequences of equal length: K5 keys, NVFP4 values (SPEC 6).

    ``max_tokens=None`` grows by reallocating (doubling) its page pool; an ``int`` preallocates
    that capacity once (no reallocation, so decode calls can be captured in a CUDA graph) and
    appending past it is an error. ``page_size`` tokens per page (default 128).

    ``window=W``: a sliding-window cache for attention that sees each query's last ``W`` keys. It
    keeps the last ``W + 15`` tokens (all that a decode of up to 16 query positions reads) in a
    fixed ring of pages per sequence, so its memory does not grow with the sequence: token ``t``
    lives in page ``t // page_size`` of the block table, whose entries cycle through the ring.
    Its decodes use the window; ``dequantize`` returns the kept tokens, from ``start`` on.
    ``rollback=N`` keeps ``N`` tokens more, so that ``crop`` can drop up to ``N`` tokens and the
    cache still decodes up to 16 positions (up to ``N + 16`` for the next positions' decodes).

    Not thread-safe: appends, ``select`` and growth replace its tensors one at a time, so a decode
    in another thread at that moment may read new pages through the old block table.

    ``residual_length=R`` (default 16; 0 turns it off): each query reads its newest ``R`` keys and
    values as they were appended, not quantized, from a ring of the last ``R + 15`` tokens
    (``res_k``, ``res_v``, in the cache's dtype; token ``t`` in slot ``t % (R + 15)``) kept beside
    the pages, which store every token quantized too. A query's result does not depend on how
    many positions its decode call serves (up to 16 see all of their newest ``R``).
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype = torch.float16,
                 device: torch.device | str | None = None, page_size: int | None = None,
                 max_tokens: int | None = None, window: int | None = None,
                 residual_length: int = DEFAULT_RESIDUAL, rollback: int = 0):
        for name, val in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if head_dim > 256:
            raise ValueError(f"head_dim must be at most 256, got {head_dim}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {[str(d) for d in _DTYPES]}, got {dtype}")
        page_size = DEFAULT_PAGE_SIZE if page_size is None else page_size
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if not isinstance(residual_length, int) or isinstance(residual_length, bool) or residual_length < 0:
            raise ValueError(f"residual_length must be an int >= 0, got {residual_length!r}")
        if not isinstance(rollback, int) or isinstance(rollback, bool) or rollback < 0:
            raise ValueError(f"rollback must be an int >= 0, got {rollback!r}")
        if rollback and window is None:
            raise ValueError("rollback applies to a windowed cache (window=...): any other crops "
                             "any number of tokens")
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.dtype, self.page_size, self.max_tokens = dtype, page_size, max_tokens
        self.window = window
        # a windowed cache keeps the last _keep tokens (all its decodes can read) in a ring of pages
        # that holds them wherever they start in a page, plus the page being filled
        self.rollback = rollback
        self._keep = None if window is None else window + MAX_DECODE_QUERIES - 1 + rollback
        self._ring = None if window is None else -(-self._keep // page_size) + 1
        # a windowed cache's mean: of at most the tokens it keeps (the ring holds them all)
        self._kmean_tokens = KMEAN_TOKENS if window is None else min(KMEAN_TOKENS, self._keep)
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", comparable
        self._len = 0
        self._oldest = 0  # a windowed cache cropped after it dropped tokens: none before this
        self._early = None  # (k, v) of the stored tokens until K's statistics are fixed: exact copies
        self._padding = [0] * batch  # leading pad tokens per sequence, left out of K's statistics
        self.kmean = torch.zeros(batch, kv_heads, head_dim, dtype=torch.float32, device=self.device)
        self.kscale = torch.ones(batch, kv_heads, head_dim, dtype=torch.float32, device=self.device)
        self.residual_length = residual_length
        slots = residual_length + MAX_DECODE_QUERIES - 1 if residual_length else 0
        self.res_k = torch.zeros(batch, kv_heads, slots, head_dim, dtype=dtype, device=self.device)
        self.res_v = torch.zeros_like(self.res_k)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        pages = -(-max_tokens // page_size) if max_tokens is not None else 1
        self._allocate(pages)

    # ------------------------------------------------------------------ storage

    def _allocate(self, pages_per_seq: int) -> None:
        """(Re)allocates for pages_per_seq logical pages per sequence, keeping the stored pages: the
        pool and the block table, or for a windowed cache its block table only (the ring's pool
        is allocated once)."""
        B, H, P, D = self.batch, self.kv_heads, self.page_size, self.head_dim
        pool_pages = self._ring if self._ring is not None else pages_per_seq
        old = getattr(self, "_pages_per_seq", 0)
        if not old or self._ring is None:
            n = B * pool_pages
            u8 = {"dtype": torch.uint8, "device": self.device}
            new = {
                "k_codes": torch.zeros(n, H, P, reference.k5_code_bytes(D), **u8),
                "k_scales": torch.zeros(n, H, P, reference.k5_scale_count(D), **u8),
                "k_exp": torch.zeros(n, H, P, **u8),
                "v_codes": torch.zeros(n, H, P, code_bytes(D), **u8),
                "v_scales": torch.zeros(n, H, P, scale_count(D), **u8),
                "v_dec": torch.zeros(n, H, P, dtype=torch.float32, device=self.device),
            }
            if old:
                for name, t in new.items():  # page i of sequence b is b * pages_per_seq + i
                    t.view(B, pages_per_seq, *t.shape[1:])[:, :old] = \
                        getattr(self, name).view(B, old, *t.shape[1:])
            for name, t in new.items():
                setattr(self, name, t)
        self._pages_per_seq = pages_per_seq
        self._set_block_table()

    def _pool_pages(self) -> int:
        """Pool pages per sequence: sequence b's are b * _pool_pages() + [0, _pool_pages())."""
        return self._ring if self._ring is not None else self._pages_per_seq

    def _set_block_table(self) -> None:
        seq = torch.arange(self.batch, dtype=torch.int32, device=self.device)[:, None] * \
            self._pool_pages()
        page = torch.arange(self._pages_per_seq, dtype=torch.int32, device=self.device)
        self.block_table = seq + (page if self._ring is None else page % self._ring)

    def select(self, indices) -> None:
        """Keeps the sequences ``indices`` (a 1-D int tensor or list: any count, repeats allowed),
        in that order, with everything that is theirs (pages, K's statistics, padding, the
        residual ring): beam search's reorder, a batch repeated or narrowed. Copies into new
        tensors, so that sequences that were one continue apart (a CUDA graph that captured the
        old ones must be captured again). On bad input nothing is changed."""
        idx = torch.as_tensor(indices)
        picked = idx.tolist() if idx.dim() == 1 else None  # one host copy, checked here
        if picked is None or not picked or idx.dtype.is_floating_point or \
                idx.dtype == torch.bool or not all(0 <= i < self.batch for i in picked):
            raise ValueError(f"indices must be a non-empty 1-D list or tensor of ints in "
                             f"[0, {self.batch}), got {indices!r}")
        idx = torch.tensor(picked, dtype=torch.long, device=self.device)
        n = self._pool_pages()
        for name in ("k_codes", "k_scales", "k_exp", "v_codes", "v_scales", "v_dec"):
            t = getattr(self, name)
            rows = t.view(self.batch, n, *t.shape[1:])[idx]
            setattr(self, name, rows.reshape(idx.numel() * n, *t.shape[1:]))
        for name in ("kmean", "kscale", "res_k", "res_v", "seq_lens"):
            setattr(self, name, getattr(self, name)[idx].contiguous())
        if self._early is not None:
            self._early = (self._early[0][idx], self._early[1][idx])
        self._padding = [self._padding[i] for i in picked]
        self.batch = len(picked)
        self._set_block_table()

    def crop(self, length: int) -> None:
        """Keeps the first ``length`` tokens of every sequence (``0 <= length <= len(cache)``):
        speculative decoding's rejected tokens dropped. The cache then decodes as one that was
        appended only those tokens, with two differences: K's statistics, once fixed, stay
        those of the first tokens stored, cropped ones included; and the residual ring's slots
        of the kept tokens that cropped ones overwrote (the oldest ``c`` of its last
        ``residual_length + 15``, for a crop of ``c``) hold those tokens' stored values
        (dequantized, in the cache's dtype) until new tokens replace them, which a one-position
        decode reads from a crop of more than 15 tokens on, a 16-position one from any crop.
        A windowed cache that has dropped tokens can drop only tokens whose removal leaves the
        next position's window stored (``rollback + 16``), and its decodes of earlier positions
        then refuse those whose windows reach dropped tokens. On bad input nothing is
        changed."""
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self._len:
            raise ValueError(f"length must be an int in [0, {self._len}], got {length!r}")
        if length == self._len:
            return
        early = self._early if self._early is not None and self._early[0].shape[2] == self._len \
            else None  # K's statistics still open: the kept tokens are stored again, as if alone
        if length == 0 or early is not None:
            self._len, self._early, self._oldest = 0, None, 0
            self.seq_lens.fill_(0)
            if length:  # (with the padding it had; K's mean and scales set anew)
                self.append(early[0][:, :, :length], early[1][:, :, :length])
            else:  # as new
                self._padding = [0] * self.batch
                self.kmean.zero_()
                self.kscale.fill_(1.0)
            return
        oldest = self.start  # stored tokens from here on
        if self.window is not None and oldest > max(0, length - self.window + 1):
            raise ValueError(f"crop to {length} tokens: this windowed cache (window={self.window}, "
                             f"rollback={self.rollback}) keeps tokens from position {oldest} on, "
                             f"but a query at position {length} sees its last {self.window} keys "
                             f"from position {length - self.window + 1}: it can drop at most "
                             f"{self._len - oldest - self.window + 1} tokens (a larger rollback "
                             f"keeps more)")
        slots = self.res_k.shape[2]
        # ring slots of positions below `length` that later positions (now cropped) overwrote
        stale = range(max(length - slots, oldest), min(length, self._len - slots))
        if len(stale):
            k, v = self._stored(stale.start, stale.stop)
            at = torch.arange(stale.start, stale.stop, device=self.device) % slots
            big = torch.finfo(self.dtype).max  # (a stored value may exceed the dtype's range)
            self.res_k.index_copy_(2, at, k.clamp(-big, big).to(self.dtype))
            self.res_v.index_copy_(2, at, v.clamp(-big, big).to(self.dtype))
        self._oldest = oldest  # (0 without a window)
        self._len = length
        self.seq_lens.fill_(length)

    def storage(self) -> tuple[Tensor, ...]:
        """(k_codes, k_scales, k_exp, v_codes, v_scales, v_dec, kmean, kscale, block_table): the
        paged form `decode_paged` takes (SPEC 6), with ``seq_lens`` and ``**residual()``. A
        windowed cache's pages are a ring that holds the last ``window + 15 + rollback``: pass
        ``window`` <= its window and at most 16 query rows (`decode` does), else a decode reads
        newer tokens in older ones' places. The residual ring holds the tokens before
        ``len(cache)``: a ``seq_lens`` below it reads the wrong ones there."""
        return (self.k_codes, self.k_scales, self.k_exp, self.v_codes, self.v_scales, self.v_dec,
                self.kmean, self.kscale, self.block_table)

    @property
    def capacity(self) -> int:
        """Tokens the block table addresses before it grows (a windowed cache keeps fewer)."""
        return self._pages_per_seq * self.page_size

    @property
    def start(self) -> int:
        """Position of the first token `dequantize` returns: 0, or for a windowed cache the first
        of the kept ``window + 15 + rollback`` (or a crop's first kept)."""
        if self.window is None:
            return 0
        return max(0, self._len - self._keep, self._oldest)

    def residual(self) -> dict:
        """The residual ring as `decode_paged` takes it: ``residual_k``, ``residual_v`` (None
        when ``residual_length`` is 0) and ``residual_length``."""
        on = self.residual_length > 0
        return {"residual_k": self.res_k if on else None, "residual_v": self.res_v if on else None,
                "residual_length": self.residual_length}

    @property
    def nbytes(self) -> int:
        """Bytes of all storage: pages, scales, decs, kmean, kscale, block table, lengths and the
        residual ring."""
        return sum(t.numel() * t.element_size()
                   for t in (*self.storage(), self.seq_lens, self.res_k, self.res_v))

    def __len__(self) -> int:
        return self._len

    # ------------------------------------------------------------------ appending and reading

    @property
    def padding(self) -> tuple[int, ...]:
        """Per sequence, how many of its first tokens are padding (left out of K's statistics)."""
        return tuple(self._padding)

    @property
    def statistics_fixed(self) -> bool:
        """Whether K's mean and channel scales are final (every sequence has its first
        ``KMEAN_TOKENS`` tokens after its padding stored, or ``EARLY_TOKENS`` are); until then
        appends may change the padding."""
        return self._len > 0 and self._early is None

    def append(self, k: Tensor, v: Tensor, padding=None) -> None:
        """Appends ``n >= 1`` tokens to every sequence: ``k, v [batch, kv_heads, n, head_dim]`` in
        the cache's dtype and device. K's mean and channel scales are those of the first
        ``KMEAN_TOKENS`` tokens stored (a windowed cache: at most the ``window + 15 + rollback``
        it keeps, and it stores only the last that many of an append); until that many are
        stored, each append stores them all again with the mean and scales of those so far, so
        the cache does not depend on how its first tokens were split into appends. On bad input
        nothing is changed.

        ``padding`` (a left-padded batch): per sequence, how many of its first tokens are padding
        (``batch`` ints >= 0; None: as before, initially none). They are stored but left out of
        K's statistics, which are then those of each sequence's first ``KMEAN_TOKENS`` tokens
        after its padding; the cache keeps storing its first tokens again until every sequence
        has that many, or until ``EARLY_TOKENS`` (256) are stored (a sequence then short of them
        keeps the statistics of those it has). It can change only while ``statistics_fixed`` is
        False; not for a windowed cache."""
        shape = (self.batch, self.kv_heads, None, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4 or any(
                    s is not None and t.shape[i] != s for i, s in enumerate(shape)):
                raise ValueError(f"{name} must be [batch={self.batch}, kv_heads={self.kv_heads}, n, "
                                 f"head_dim={self.head_dim}], got {tuple(getattr(t, 'shape', ()))}")
            if t.dtype != self.dtype or t.device != self.device:
                raise ValueError(f"{name} must be {self.dtype} on {self.device}, got {t.dtype} on {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        n = k.shape[2]
        if n < 1:
            raise ValueError("append needs at least one token")
        padding = self._padding if padding is None else self._checked_padding(padding)
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad) and \
                not torch.compiler.is_dynamo_compiling():  # (a warning would break fullgraph)
            warnings.warn("FP4KVCache.append: k or v requires grad, but the cache stores them "
                          "without a graph: no gradient flows back through it (call it under "
                          "torch.no_grad() to silence this)", stacklevel=2)
        k, v = k.detach(), v.detach()  # the ring and the first tokens' copy keep no graph alive
        need = self._len + n
        if self.max_tokens is not None and need > self.max_tokens:
            raise ValueError(f"appending {n} tokens to {self._len} exceeds max_tokens={self.max_tokens}")
        if need > self.capacity:
            self._allocate(max(2 * self._pages_per_seq, -(-need // self.page_size)))
        skip = 0  # a windowed cache stores only the tokens a decode can still read
        if self.window is not None:
            skip = max(0, n - self._keep)
        start = self._len + skip
        k, v = k[:, :, skip:], v[:, :, skip:]
        ring = min(k.shape[2], self.res_k.shape[2])  # the ring: the newest tokens as given
        ring_kv = (k[:, :, k.shape[2] - ring:], v[:, :, k.shape[2] - ring:])
        if self._early is not None and not skip:  # the stored tokens, exactly, before the new ones
            start = self._len - self._early[0].shape[2]
            k, v = torch.cat((self._early[0], k), dim=2), torch.cat((self._early[1], v), dim=2)
        if self._len == 0 or self._early is not None:  # kmean, kscale of the first tokens stored
            # each sequence's statistics: its first _kmean_tokens after its padding (SPEC 6)
            skip_rows = [min(max(0, p - start), k.shape[2]) for p in padding]
            want = self._kmean_tokens + max(skip_rows)
            m = min(want, k.shape[2])
            mean_from = None if not any(skip_rows) else \
                torch.tensor(skip_rows, dtype=torch.int32).to(self.device, non_blocking=True)
            torch.ops.fp4attn.kv_append(k[:, :, :m], v[:, :, :m], *self.storage(), start, True,
                                        mean_from, self._kmean_tokens)
            # open while a sequence lacks tokens, up to EARLY_TOKENS kept: a long padded prompt
            # beside a short one would otherwise keep a full-precision copy of the whole prompt
            open_ = m < want and k.shape[2] < EARLY_TOKENS
            self._early = (k.clone(), v.clone()) if open_ else None
            k, v, start = k[:, :, m:], v[:, :, m:], start + m
        if k.shape[2]:
            torch.ops.fp4attn.kv_append(k, v, *self.storage(), start, False)
        if ring:
            slots = torch.arange(need - ring, need, device=self.device) % self.res_k.shape[2]
            self.res_k.index_copy_(2, slots, ring_kv[0])
            self.res_v.index_copy_(2, slots, ring_kv[1])
        self._len, self._padding = need, padding
        self.seq_lens.fill_(need)

    def _checked_padding(self, padding) -> list[int]:
        if self.window is not None:
            raise ValueError("padding: a windowed cache does not take padding (its statistics are "
                             "those of the tokens it keeps)")
        values = _per_sequence_ints(padding, self.batch, "padding")
        if self.statistics_fixed and values != self._padding:
            raise ValueError(f"padding {values} after K's statistics were fixed with padding "
                             f"{self._padding}: it can change only until every sequence has its "
                             f"first {self._kmean_tokens} tokens after its padding stored")
        return values

    def _stored(self, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """Float32 ``(k, v)`` ``[batch, kv_heads, hi - lo, head_dim]``: the stored rows of
        positions ``[lo, hi)`` (``start <= lo < hi <= len``), dequantized (K times its channel
        scales, then plus its mean)."""
        first = lo // self.page_size  # logical pages from the one holding `lo` (one if empty)
        table = self.block_table[:, first:max(-(-hi // self.page_size), first + 1)]
        end = hi - first * self.page_size
        k = _dequantize_rows(self.k_codes, self.k_scales, self.k_exp, table, end, self.head_dim, key=True)
        v = _dequantize_rows(self.v_codes, self.v_scales, self.v_dec, table, end, self.head_dim)
        at = lo - first * self.page_size
        return k[:, :, at:] * self.kscale[:, :, None, :] + self.kmean[:, :, None, :], v[:, :, at:]

    def dequantize(self, dtype: torch.dtype | None = None, residual: bool = True,
                   position: int | None = None) -> tuple[Tensor, Tensor]:
        """``(k, v)`` ``[batch, kv_heads, len - start, head_dim]`` of the tokens from ``start`` on
        (all of them unless a window dropped older ones): the values the query at ``position``
        (default: the newest, ``len - 1``, as in a one-token decode) computes with. K times its
        channel scales, then plus its mean (one float32 multiplication and one addition); that
        query's residual keys and values (its newest ``residual_length`` still in the ring, and
        the ring's tokens after it, which that query does not see) as appended, unless
        ``residual=False`` (the stored rows of every token). In ``dtype``
        (default: the cache's); a 16-bit dtype rounds them once more."""
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {[str(d) for d in _DTYPES]} or None, got {dtype}")
        if position is None:
            position = self._len - 1
        elif not isinstance(position, int) or isinstance(position, bool) or not 0 <= position < self._len:
            raise ValueError(f"position must be an int in [0, {self._len}), got {position!r}")
        k, v = self._stored(self.start, self._len)
        if residual and self.residual_length:  # tokens > position - R still in the ring
            slots = self.res_k.shape[2]
            ring = max(position - self.residual_length + 1, self._len - slots, self.start)
            if ring < self._len:
                at = torch.arange(ring, self._len, device=self.device) % slots
                k[:, :, ring - self.start:] = self.res_k.index_select(2, at).float()
                v[:, :, ring - self.start:] = self.res_v.index_select(2, at).float()
        dtype = self.dtype if dtype is None else dtype
        return k.to(dtype), v.to(dtype)


def _per_sequence_ints(values, batch: int, name: str) -> list[int]:
    """One int >= 0 per sequence (a list, tuple or tensor), as a list; else a ValueError."""
    got = values.tolist() if isinstance(values, Tensor) else values
    if not isinstance(got, (list, tuple)) or len(got) != batch or any(
            not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in got):
        raise ValueError(f"{name} must be {batch} ints >= 0 (one per sequence), got {values!r}")
    return list(got)


def _dequantize_rows(codes, scales, dec, block_table, length: int, D: int, key: bool = False) -> Tensor:
    """Float32 [B, H, length, D] of the stored rows of every sequence (equal lengths): key rows
    (K5, ``dec`` the row-scale bytes) or value rows (NVFP4)."""
    B, pages = block_table.shape
    P = codes.shape[2]
    idx = block_table.long()  # [B, pages] -> the pool's rows in token order
    c = codes[idx].permute(0, 2, 1, 3, 4).reshape(B, codes.shape[1], pages * P, -1)[:, :, :length]
    s = scales[idx].permute(0, 2, 1, 3, 4).reshape(B, scales.shape[1], pages * P, -1)[:, :, :length]
    d = dec[idx].permute(0, 2, 1, 3).reshape(B, dec.shape[1], pages * P)[:, :, :length]
    if key:
        return reference.k5_dequantize(c, s, d, D)
    return reference.dequantize(c[..., None, :], s[..., None, :], d, D)[..., 0, :]


def decode_paged(q: Tensor, k_codes: Tensor, k_scales: Tensor, k_exp: Tensor, v_codes: Tensor,
                 v_scales: Tensor, v_dec: Tensor, kmean: Tensor, kscale: Tensor,
                 block_table: Tensor, seq_lens: Tensor, scale: float | None = None,
                 return_lse: bool = False, window: int | None = None, *,
                 residual_k: Tensor | None = None, residual_v: Tensor | None = None,
                 residual_length: int = 0, key_start: Tensor | None = None):
    """Decode attention on a paged FP4 cache (SPEC 6). ``q [B, Hq, nq, D]``: the last ``nq``
    positions of each sequence; ``seq_lens [B]`` int32 (may differ per sequence and change between
    CUDA-graph replays); ``block_table [B, max_pages]`` int32. ``window``: sliding-window attention,
    each query sees only its last ``window`` keys (itself included). ``residual_length=R > 0``:
    each query reads its newest ``R`` keys still in the ring ``residual_k, residual_v [B, Hkv, S,
    D]`` (q's dtype, ``S >= R`` slots, token ``t`` of a sequence in slot ``t % S``: the caller
    keeps each sequence's last ``S`` tokens there) instead of the pages. ``key_start [B]`` int32
    on q's device: sequence ``b``'s queries see no key before ``key_start[b]`` (a left-padded
    batch's padding; values below 0 act as 0; a query left without keys gives 0 and lse -inf).
    Returns ``out`` (q's dtype), and ``lse [B, Hq, nq]`` float32 with ``return_lse``."""
    if not isinstance(q, Tensor) or q.dtype not in _DTYPES:
        raise ValueError(f"q must be a float16, bfloat16 or float32 tensor, got {getattr(q, 'dtype', q)!r}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    if not isinstance(residual_length, int) or isinstance(residual_length, bool) or residual_length < 0:
        raise ValueError(f"residual_length must be an int >= 0, got {residual_length!r}")
    if (residual_k is None) != (residual_v is None) or (residual_k is None) != (residual_length == 0):
        raise ValueError("residual_k and residual_v are given together, exactly when "
                         f"residual_length > 0 (got residual_length={residual_length})")
    if torch.is_grad_enabled() and q.requires_grad and not torch.compiler.is_dynamo_compiling():
        warnings.warn("fp4attn.decode: q requires grad, but the decode has no backward: no "
                      "gradient flows back to q (call it under torch.no_grad() to silence this)",
                      stacklevel=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, lse = torch.ops.fp4attn.decode(q, k_codes, k_scales, k_exp, v_codes, v_scales, v_dec, kmean,
                                        kscale, block_table, seq_lens, scale, window or 0,
                                        residual_k, residual_v, residual_length, key_start)
    return (out, lse) if return_lse else out


def decode(q: Tensor, cache: FP4KVCache, scale: float | None = None, return_lse: bool = False,
           window: int | None = None, *, key_start=None):
    """Decode attention of ``q [B, Hq, nq, D]`` (the last ``nq`` positions: query ``t`` sees keys
    ``0 .. len(cache) - nq + t``, or only the last ``window`` of them) on an :class:`FP4KVCache`;
    ``Hq`` a multiple of its KV heads. ``key_start``: per sequence, the first key its queries see
    (``cache.padding`` for a left-padded batch: the pads are not attended), ints >= 0; an int32
    contiguous ``[B]`` tensor on the cache's device is used as is (no copy, no host
    synchronisation; a value below 0 acts as 0)."""
    if not isinstance(cache, FP4KVCache):
        raise ValueError(f"cache must be an fp4attn.FP4KVCache, got {type(cache).__name__}")
    if not isinstance(q, Tensor) or q.dim() != 4 or q.shape[0] != cache.batch or \
            q.shape[3] != cache.head_dim or q.shape[1] % cache.kv_heads:
        raise ValueError(f"q must be [batch={cache.batch}, heads (a multiple of {cache.kv_heads}), nq, "
                         f"head_dim={cache.head_dim}], got {tuple(getattr(q, 'shape', ()))}")
    if q.dtype != cache.dtype or q.device != cache.device:
        raise ValueError(f"q must be {cache.dtype} on {cache.device}, got {q.dtype} on {q.device}")
    if not 1 <= q.shape[2] <= len(cache):
        raise ValueError(f"q has {q.shape[2]} positions; the cache holds {len(cache)} tokens")
    if cache.window is not None:  # older tokens are gone: the cache's window at most
        if q.shape[2] > MAX_DECODE_QUERIES:
            raise ValueError(f"q has {q.shape[2]} positions; a windowed cache serves at most "
                             f"{MAX_DECODE_QUERIES}")
        if window is not None and window > cache.window:
            raise ValueError(f"window={window} exceeds the cache's window={cache.window}")
        window = cache.window if window is None else window
        first = len(cache) - q.shape[2] - window + 1  # where the first query's window starts
        if cache.start > max(0, first):  # (only after a crop)
            raise ValueError(f"q has {q.shape[2]} positions; this windowed cache, cropped to "
                             f"{len(cache)} tokens, no longer stores the keys before position "
                             f"{cache.start} that the first one's window sees")
    as_is = isinstance(key_start, Tensor) and key_start.dtype == torch.int32 and \
        key_start.device == cache.device and key_start.shape == (cache.batch,) and \
        key_start.is_contiguous()
    if key_start is not None and not as_is:
        key_start = torch.tensor(_per_sequence_ints(key_start, cache.batch, "key_start"),
                                 dtype=torch.int32).to(cache.device, non_blocking=True)
    return decode_paged(q, *cache.storage(), cache.seq_lens, scale=scale, return_lse=return_lse,
                        window=window, key_start=key_start, **cache.residual())
