"""Pure-PyTorch reference of docs/SPEC_INT8.md: 8-bit attention forward and backward (SageBwd).

The oracle the INT8 backends are tested against, written to be obviously right rather than fast:
vectorised over batch, heads and rows, looping over the 128-key blocks of the online softmax like
the kernels. INT8 codes and 16-bit values (P16, V16; e4m3 values for the FP8 study variant)
are kept as float32 tensors (NaN inputs stay visible), and every matmul of them runs in float64:
exact for the 8-bit ones, exact products summed in float64 for the 16-bit P.V; the scales are
applied afterwards in float32 in the order SPEC_INT8 writes them.

Layouts as in ``fp4attn.reference``: ``q [B, Hq, Nq, D]``, ``k / v [B, Hkv, Nk, D]``, query head
``h`` reads KV head ``h // (Hq // Hkv)``; masks broadcast to ``[B, Hq, Nq, Nk]``; causal is
top-left.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .reference import (_as_float32, _check_qkv, _div_rn, _mask_bias, _mask_scores, _normalise,
                        _online_softmax_step)

__all__ = ["BK", "BKS", "BQ", "E4M3_MAX", "PMAX", "QMAX", "attention_backward",
           "attention_forward", "channel_migration", "psi", "psi_e4m3_pair"]

#: Query rows per INT8 block (one scale for Q^ per block; the backward's row blocks).
BQ = 64
#: Keys per INT8 block and per online-softmax step.
BK = 128
#: The ``ds_product="int8"`` study: keys per dQ-side dS^ scale of a row (half a key block).
BKS = 64
#: Largest INT8 code magnitude.
QMAX = 127.0
#: Largest code of P in INT8 P.V (``attention_forward(..., pv="int8")``, SPEC_INT8 before the
#: FP8 P.V; unsigned bytes: P is never negative).
PMAX = 255.0
#: Largest finite FP8 e4m3 (``torch.float8_e4m3fn``) value: the scale of the forward's
#: ``W = 448 exp(S - m_new)`` (SPEC_INT8 2.4, from the FP8 P.V, whose P~ and V~ put a row's
#: running maximum and a V group's amax there; ``pv="fp8"``).
E4M3_MAX = 448.0


def psi(x: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """SPEC_INT8 1: symmetric INT8 quantization with one scale per group, a group being all
    elements that share every index outside ``dims`` (float32 in). Returns (codes, scales): codes
    integer-valued float32 in [-127, 127] (NaN where the group's amax is NaN), scales float32
    with size 1 along ``dims``; ``codes * scales`` dequantizes."""
    amax = x.abs().amax(dim=dims, keepdim=True)
    recip = _div_rn(QMAX, amax)  # +inf where amax is 0 or too small to invert (< 127 / FLT_MAX)
    flush = recip == math.inf
    scale = torch.where(flush, 0.0, _div_rn(amax, QMAX))
    codes = torch.clamp(torch.round(x * torch.where(flush, 0.0, recip)), -QMAX, QMAX)
    return codes, scale


def _e4m3(x: Tensor) -> Tensor:
    """x (float32) rounded to FP8 e4m3 (round to nearest even, subnormals kept; |x| <= 448; NaN
    stays NaN), as float32 values."""
    return x.to(torch.float8_e4m3fn).to(torch.float32)


def psi_e4m3_pair(x: Tensor, dims: tuple[int, ...], lo_scale: float = 1.0
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """V as two FP8 e4m3 terms with one scale per group, the FP8 P.V's V (SPEC_INT8 2.2 before
    the 16-bit P.V; ``attention_forward(..., pv="fp8")``; ``dims`` as for psi; float32 in). Per
    group ``r = 448 / amax`` and ``sV = amax / 448`` (correctly rounded FP32), ``y = x * r``
    (FP32), ``V~ = e4m3(clamp(y, -448, 448))``, ``R = e4m3(y - V~)``: ``y - V~`` is exact in
    FP32 and at most half an e4m3 step (16 in the top binade), so R needs no clamp. Where
    ``r == +inf`` (amax 0, or below 448 / FLT_MAX) sV, V~ and R are 0, as psi flushes; NaN
    propagates. Returns (V~, R, sV), V~ and R as float32 values; ``(V~ + R) * sV`` dequantizes
    (``V~ + R`` is exact in FP32). ``lo_scale`` (accuracy study, ``attention_forward(...,
    pv="fp8-r16")``, 16): ``R = e4m3(lo_scale (y - V~)) / lo_scale``, the residual scaled out of
    e4m3's subnormals (a kernel would need a second accumulator); 1 is ``pv="fp8"``."""
    amax = x.abs().amax(dim=dims, keepdim=True)
    recip = _div_rn(E4M3_MAX, amax)
    flush = recip == math.inf
    scale = torch.where(flush, 0.0, _div_rn(amax, E4M3_MAX))
    y = x * torch.where(flush, 0.0, recip)
    hi = _e4m3(torch.clamp(y, -E4M3_MAX, E4M3_MAX))
    return hi, _e4m3(lo_scale * (y - hi)) / lo_scale, scale


def _migrate_kw(migrate: float | None, migrate_pow2: bool | None) -> dict:
    """The migration keywords for _Quantized, checked (``migrate=None``: no migration)."""
    if migrate is None:
        if migrate_pow2 is not None:
            raise ValueError("migrate_pow2 needs migrate= (the exponent alpha, e.g. 0.5); "
                             "migrate=None turns the channel migration off")
        return {"migrate": None}
    if not 0.0 <= float(migrate) <= 1.0:
        raise ValueError(f"migrate (alpha) must be in [0, 1], got {migrate}")
    return {"migrate": float(migrate), "migrate_pow2": True if migrate_pow2 is None
            else bool(migrate_pow2)}


def channel_migration(q32: Tensor, k32: Tensor, kbar: Tensor, G: int, alpha: float = 0.5,
                      pow2: bool = True) -> Tensor:
    """Per-channel Q<->K migration factors ``s`` [B, Hkv, 1, D], float32: SPEC_INT8 2.1b with the
    defaults (alpha 0.5, power of two); other alphas and the exact s are for accuracy studies
    (docs/accuracy.md "INT8 channel migration"). Per (batch, KV head) and channel c:

    ``ka_c = max(fl(kmax_c - kbar_c), fl(kbar_c - kmin_c))`` (NaN propagates), kmax / kmin the
    column max / min of K over the Nk keys: the same FP32 number as ``max |K_c - kbar_c|`` over
    the smoothed keys, since rounding is monotonic (the kernel's prepare pass gets it from the
    channel's max and min in the pass that sums kbar); ``qa_c = max |Q_c|`` over the Nq rows of
    the KV head's G query heads (NaN propagates). Both over the whole sequence, whatever the masks.

    ``pow2`` (the spec), alpha 0.5: ``s_c = 2^ceil(E / 2)``, ``E`` the exponent of the FP32
    quotient ``r = fl(ka_c / qa_c) = m 2^E``, m in [1, 2) (ties, r an odd power of two, go up),
    so that ``Q_c * s_c`` and ``Ks_c / s_c`` are exact in floating point (unless a result is
    subnormal, where both are correctly rounded); other alphas: ``2^floor(log2(s_c) + 1/2)``
    of the exact s_c in float64. Not ``pow2``: ``s_c = ka_c^alpha / qa_c^(1 - alpha)``,
    ``sqrt(ka_c / qa_c)`` for alpha = 0.5 (two correctly rounded FP32 operations), else float64
    pow rounded to FP32. ``Q'_c = Q_c * s_c`` and ``Ks'_c = Ks_c / s_c`` then have the channel
    maxima ``qa^(1-alpha) ka^alpha`` and ``qa^alpha ka^(1-alpha)`` (alpha = 0.5: both about
    ``sqrt(qa ka)``), and ``Q' Ks'^T = Q Ks^T``.

    ``s_c = 2^-63`` where ka_c = 0 and qa_c is a normal finite FP32 number (the channel's
    smoothed keys are all 0, so it adds nothing to a score; its query channel must not set its
    rows' scale); otherwise ``s_c = 1`` unless qa_c and ka_c are normal finite FP32 numbers
    (>= 2^-126: zero, subnormal, inf and NaN give 1) and, for alpha 0.5, so is r (a quotient that
    over- or underflows gives 1), and s_c is a finite positive number."""
    B, Hq, _, D = q32.shape
    Hkv = k32.shape[1]
    kmax = k32.amax(dim=2, keepdim=True)
    kmin = k32.amin(dim=2, keepdim=True)
    ka = torch.maximum(kmax - kbar, kbar - kmin)  # = max |K - kbar| per channel, [B, Hkv, 1, D]
    qa = q32.abs().amax(dim=2).reshape(B, Hkv, G, D).amax(dim=2)[:, :, None]  # [B, Hkv, 1, D]
    tiny = torch.finfo(torch.float32).tiny
    keys_zero = (ka == 0) & (qa >= tiny) & (qa < math.inf)
    ok = (qa >= tiny) & (ka >= tiny) & (qa < math.inf) & (ka < math.inf)  # NaN: False
    one = torch.ones_like(qa)
    qa, ka = torch.where(ok, qa, one), torch.where(ok, ka, one)
    if alpha == 0.5:
        r = _div_rn(ka, qa)
        ok = ok & (r >= tiny) & (r < math.inf)
        if pow2:
            e = torch.frexp(r).exponent - 1  # r = m 2^e, m in [1, 2)
            s = torch.ldexp(one, torch.div(e + 1, 2, rounding_mode="floor"))  # 2^ceil(e / 2)
        else:
            s = torch.sqrt(r)
    else:
        ls = alpha * torch.log2(ka.double()) - (1.0 - alpha) * torch.log2(qa.double())
        s = torch.exp2(torch.floor(ls + 0.5) if pow2 else ls).to(torch.float32)
    ok = ok & torch.isfinite(s) & (s > 0)
    return torch.where(keys_zero, 2.0 ** -63, torch.where(ok, s, one))


def _blocks(x: Tensor, block: int) -> Tensor:
    """[B, H, N, D] -> [B, H, nb, block, D], rows zero-padded to a multiple of ``block``."""
    B, H, N, D = x.shape
    nb = -(-N // block)
    return torch.nn.functional.pad(x, (0, 0, 0, nb * block - N)).reshape(B, H, nb, block, D)


def _per_q_head(x: Tensor, G: int) -> Tensor:
    """A per-KV-head tensor [B, Hkv, ...] repeated for the G query heads of each KV head."""
    return x.repeat_interleave(G, dim=1) if G > 1 else x


def _mm64(a: Tensor, b: Tensor) -> Tensor:
    """a @ b in float64, rounded once to float32: exact for the 8-bit operands (integers, or
    e4m3 P~ times V~ + R: multiples of 2^-22 below 2^25); P16 times V16 (the spec's P.V) has
    exact products (two 16-bit significands) summed in float64."""
    return torch.matmul(a.double(), b.double()).to(torch.float32)


class _Quantized:
    """The forward's operands (SPEC_INT8 2.1-2.2, the channel migration 2.1b by default), shared
    with the backward, which recomputes them bit-exactly from the same inputs."""

    def __init__(self, q32: Tensor, k32: Tensor, v32: Tensor, G: int, q_block: int = BQ,
                 k_block: int = BK, migrate: float | None = 0.5, migrate_pow2: bool = True,
                 v_block: int = BK, pv: str = "16bit"):
        B, Hq, Nq, D = q32.shape
        Nk = k32.shape[2]
        self.kbar = k32.mean(dim=2, keepdim=True)  # [B, Hkv, 1, D]
        ks = k32 - self.kbar
        self.mig = None  # channel migration factors s [B, Hkv, 1, D] (None: migration off)
        if migrate is not None:
            self.mig = channel_migration(q32, k32, self.kbar, G, migrate, migrate_pow2)
            q32 = q32 * _per_q_head(self.mig, G)  # Q' = Q s, Ks' = Ks / s: Q' Ks'^T = Q Ks^T
            ks = _div_rn(ks, self.mig)
        qc, sq = psi(_blocks(q32, q_block), (3, 4))  # per q_block rows (SPEC: 64)
        kc, sk = psi(_blocks(ks, k_block), (3, 4))  # per k_block keys (SPEC: 128)
        if pv == "int8":  # INT8 codes per v_block keys (0: the whole sequence) and channel
            vb = v_block or -(-Nk // BK) * BK
            vc, sv = psi(_blocks(v32, vb), (3,))
            sv = sv.repeat_interleave(vb // BK, dim=2)  # one per 128-key softmax step
            vc = vc.reshape(*vc.shape[:2], -1, BK, D)
        elif pv == "16bit":  # the spec: V16 as given (attention_forward rounds it), no scale
            vc = _blocks(v32, BK)
            sv = vc.new_ones(*vc.shape[:3], 1, D)
        else:  # the FP8 study: V~ + R (exact in FP32) per 128 keys and channel
            hi, lo, sv = psi_e4m3_pair(_blocks(v32, BK), (3,), 16.0 if pv == "fp8-r16" else 1.0)
            vc = hi + lo
        nqb, nkb, nvb = qc.shape[2], kc.shape[2], -(-Nk // BK)
        vc, sv = vc[:, :, :nvb], sv[:, :, :nvb]
        # per row / per key, repeated over the GQA group after quantizing (scales per KV head)
        self.qc = qc.reshape(B, Hq, nqb * q_block, D)[:, :, :Nq]
        # [B, Hq, Nq, 1]
        self.sq = sq.reshape(B, Hq, nqb, 1).repeat_interleave(q_block, dim=2)[:, :, :Nq]
        self.kc = _per_q_head(kc.reshape(B, -1, nkb * k_block, D)[:, :, :Nk], G)
        # sK of every key [B, Hq, Nk] (the scores' column scales), and per 128-key block
        # [B, Hq, nvb] for the backward, which keeps SPEC_INT8's blocks (None otherwise)
        self.sk_key = _per_q_head(
            sk.reshape(B, -1, nkb, 1).repeat_interleave(k_block, dim=2)[:, :, :Nk, 0], G)
        self.sk = _per_q_head(sk.reshape(B, -1, nkb), G) if k_block == BK else None
        self.vc = _per_q_head(vc.reshape(B, -1, nvb * BK, D)[:, :, :Nk], G)
        self.sv = _per_q_head(sv.reshape(B, -1, nvb, D), G)  # [B, Hq, nvb, D]

    def scores(self, j: int, scale: float, allowed: Tensor | None, additive: Tensor | None) -> Tensor:
        """S_ij of the 128-key block j (one online-softmax step) for every query row (SPEC_INT8
        2.3), masked. sQ and sK are per row and per key, whatever their block sizes: each
        multiplies a row or a column of the integer product."""
        j0, j1 = j * BK, min((j + 1) * BK, self.kc.shape[2])
        acc = _mm64(self.qc, self.kc[:, :, j0:j1].transpose(-1, -2))
        return _mask_scores(acc * ((self.sq * self.sk_key[:, :, None, j0:j1]) * scale), allowed,
                            additive, j0, j1)


def _prepare(q, k, v, attn_mask, is_causal, scale):
    G = _check_qkv(q, k, v)
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    if v.shape[3] != D:
        raise ValueError(f"value head dim {v.shape[3]} must equal query head dim {D}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    allowed, additive = _mask_bias(attn_mask, is_causal, (B, Hq, Nq, Nk), q.device)
    return G, scale, allowed, additive


def _dp_operand(x: Tensor) -> Tensor:
    """A value as dP = dO V^T and Drow = rowsum(dO O) see it (SPEC_INT8 3), as float32: the 16-bit
    input values, FP32 inputs rounded to BF16 (FP32's range; the INT8 dS dominates the error)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        x = x.to(torch.float32).to(torch.bfloat16)
    return x.float()


def _lse_shift(q32: Tensor, kbar: Tensor, G: int, scale: float) -> Tensor:
    """scale * (q . kbar) per row: what K smoothing removes from every score of the row."""
    return scale * (q32 * _per_q_head(kbar, G)).sum(dim=-1)


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    q_block: int = BQ,
    k_block: int = BK,
    migrate: float | None = 0.5,
    migrate_pow2: bool | None = None,
    pv: str = "16bit",
    p_max: str = "tile",
    v_block: int = BK,
    p_exp: str = "fp32",
    l_sum: str = "e",
) -> tuple[Tensor, Tensor]:
    """SPEC_INT8 2: ``(out, lse)``, out float32 ``[B, Hq, Nq, D]``, lse float32 ``[B, Hq, Nq]``
    (natural log of the scaled scores, the smoothing shift ``scale * q . kbar`` added back).
    Rows that see no key give 0 and -inf.

    ``pv``, the P.V numerics. ``"16bit"`` (the default and the spec, SPEC_INT8 2.2 and 2.4-2.5):
    V16 = V in the backward's 16-bit type, no scale (FP16 and BF16 inputs as given, FP32 inputs
    rounded to nearest even to BF16: ``_dp_operand``); per 128-key step, P against the running
    row maximum, ``W = 448 * exp(S - m_new)`` (float32 exp, then one float32 product; 0 where
    S = -inf), ``P16 = W`` rounded to nearest even to V16's type (FP16 for FP16 inputs, else
    BF16; FP16 subnormals kept), ``l = alpha * l + rowsum(W)`` (W unrounded),
    ``O = alpha * O + fl(P16 V16)`` (exact products summed in float64, rounded once to float32);
    ``O / l``, and ``lse = m + log(l) - log(448) + shift``. ``"fp8"`` (SPEC_INT8 before the
    16-bit P.V, for studies): the same with V as two e4m3 terms per 128 keys and channel
    (``psi_e4m3_pair``), ``P~ = e4m3(W)`` and ``O = alpha * O + fl(P~ (V~ + R)) * sV``.
    ``"int8"`` (SPEC_INT8 before its FP8 P.V, for studies): V^ = psi(V) per 128 keys and
    channel; per step ``E = exp(S - t)`` against the step's row maximum t, ``P^ = rne(255 E)``
    (unsigned codes), ``l = alpha * l + exp(t - m_new) * rowsum(E)``,
    ``O = alpha * O + (exp(t - m_new) / 255) * (float(P^ V^) * sV)``;
    ``lse = m + log(l) + shift``. Two study variants of the FP8 P.V isolate its choices
    (docs/accuracy.md "P and V in FP8"): ``"fp8-tile"``, ``P~ = e4m3(448 E)`` against the step's
    row maximum, with the INT8 path's l and per-step factor (``exp(t - m_new) / 448``);
    ``"fp8-r16"``, V's second term ``e4m3(16 (y - V~)) / 16`` (``psi_e4m3_pair``'s
    ``lo_scale``). The backward never reads V's codes, so it is the same for every ``pv``.

    ``q_block`` / ``k_block`` (accuracy studies, docs/accuracy.md "INT8 scale granularity"):
    query rows per scale of Q^ and (smoothed) keys per scale of K^, aligned at 0 like SPEC_INT8's
    blocks; the defaults, 64 and 128, are the spec and give bit-identical results. Everything
    else (V, 128-key softmax steps, per-row P) is unchanged. ``attention_backward`` takes the
    same two (a training study).

    ``migrate``: the exponent alpha of SPEC_INT8 2.1b's Q<->K channel migration before
    quantizing, ``Q' = Q s`` and ``Ks' = (K - kbar) / s`` per channel with ``s`` from
    ``channel_migration`` (per (batch, KV head) over the sequence); ``migrate_pow2``: s a power
    of two (None, the default: yes). The defaults, 0.5 and a power of two, are the spec. Other
    values are for accuracy studies (docs/accuracy.md "INT8 channel migration"):
    ``migrate_pow2=False`` takes the exact ``s`` (alpha 0.5: ``sqrt(ka_c / qa_c)``), and
    ``migrate=None`` turns the migration off (SPEC_INT8 before the amendment; alpha 0 is not
    off: it divides Q by its channel maxima). Exact in real arithmetic (``Q' Ks'^T = Q Ks^T``);
    only the INT8 codes and scales change. The lse shift uses the unmigrated Q and kbar.

    ``p_max``, ``v_block``, ``p_exp``, ``l_sum``: studies of the INT8 P.V, ``pv="int8"`` only
    (the defaults are its form above).
    ``p_max`` / ``v_block`` (a kernel that accumulates P^ V^ in int32 across key steps,
    docs/accuracy.md "INT8 P and V scales across key steps"): ``p_max="running"`` codes P
    against the running row maximum, ``P^ = rne(255 exp(S - m_new))``, instead of the step's
    (``"tile"``); ``v_block`` keys per V scale and channel, a multiple of 128 or 0 for one scale
    per channel over the whole sequence.

    ``p_exp`` (a kernel that takes P's exponentials two per instruction, ``ex2.approx.f16x2``;
    docs/accuracy.md "P's exponentials in FP16"): ``"fp32"`` or ``"fp16"``,
    E = fp16(exp2(fp16((S - t) log2 e))) (argument and result rounded to FP16, the exponential
    itself exact), or ``"fp16-noisy"``, that E times (1 + u) with u uniform in +-2^-9.9 (PTX's
    bound on ex2.approx.f16's relative error; drawn from a generator seeded 0 at every call),
    then rounded to FP16 again. P^ is rne(255 E) of that E (exact in FP16 arithmetic: one FMA
    onto 1024) and l sums it in FP32. Forward only (attention_backward recomputes P in FP32),
    with ``p_max="tile"``. ``l_sum="codes"`` (same study: a kernel whose P^ V^ product also sums
    P^ on the tensor cores, a column of ones beside V^) sums the row's codes / 255 into l
    instead of E (``"e"``)."""
    if q_block < 1 or k_block < 1:
        raise ValueError(f"q_block and k_block must be >= 1, got {q_block}, {k_block}")
    if pv not in ("16bit", "fp8", "int8", "fp8-tile", "fp8-r16"):
        raise ValueError(f'pv must be "16bit", "fp8", "int8", "fp8-tile" or "fp8-r16", got {pv!r}')
    if p_max not in ("tile", "running"):
        raise ValueError(f'p_max must be "tile" or "running", got {p_max!r}')
    if v_block < 0 or v_block % BK:
        raise ValueError(f"v_block must be 0 or a multiple of {BK}, got {v_block}")
    if p_exp not in ("fp32", "fp16", "fp16-noisy"):
        raise ValueError(f'p_exp must be "fp32", "fp16" or "fp16-noisy", got {p_exp!r}')
    if l_sum not in ("e", "codes"):
        raise ValueError(f'l_sum must be "e" or "codes", got {l_sum!r}')
    if (p_exp != "fp32" or l_sum != "e") and p_max != "tile":
        raise ValueError(f'p_exp={p_exp!r}, l_sum={l_sum!r} are modelled with p_max="tile" only, '
                         f'got {p_max!r}')
    if pv != "int8" and (p_max, v_block, p_exp, l_sum) != ("tile", BK, "fp32", "e"):
        raise ValueError(f'p_max, v_block, p_exp and l_sum study pv="int8" only, got pv={pv!r} '
                         f'with p_max={p_max!r}, v_block={v_block}, p_exp={p_exp!r}, '
                         f'l_sum={l_sum!r}')
    noise = torch.Generator().manual_seed(0) if p_exp == "fp16-noisy" else None
    mig = _migrate_kw(migrate, migrate_pow2)
    G, scale, allowed, additive = _prepare(q, k, v, attn_mask, is_causal, scale)
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    q32, k32, v32 = _as_float32(q), _as_float32(k), _as_float32(v)
    out = q32.new_zeros(B, Hq, Nq, D)
    lse = q32.new_full((B, Hq, Nq), -math.inf)
    if 0 in (B, Hq, Nq, Nk):
        return out, lse
    if pv == "16bit":
        v32 = _dp_operand(v)  # V16's values
        p16 = torch.float16 if v.dtype == torch.float16 else torch.bfloat16
    ops = _Quantized(q32, k32, v32, G, q_block, k_block, **mig, v_block=v_block, pv=pv)
    running = pv in ("16bit", "fp8", "fp8-r16")  # P against the running maximum
    pmax = PMAX if pv == "int8" else E4M3_MAX

    def code_p(e: Tensor) -> Tensor:  # per-row P from E <= 1: unsigned 8-bit codes or e4m3
        return torch.round(PMAX * e) if pv == "int8" else _e4m3(E4M3_MAX * e)

    m = q32.new_full((B, Hq, Nq), -math.inf)
    l = q32.new_zeros(B, Hq, Nq)
    for j in range(-(-Nk // BK)):
        j0, j1 = j * BK, min((j + 1) * BK, Nk)
        s_j = ops.scores(j, scale, allowed, additive)
        t, m_new, alpha, beta, e = _online_softmax_step(m, s_j)
        if running:  # W in [0, 448]; the 448 cancels in O / l
            w = E4M3_MAX * _exp_running(s_j, m_new)
            p = w.to(p16).float() if pv == "16bit" else _e4m3(w)
            l, f = alpha * l + w.sum(dim=-1), None
        else:
            if p_exp != "fp32":
                e = _exp_fp16(s_j, t, noise)
            p = code_p(e)
            l = alpha * l + beta * (e.sum(dim=-1) if l_sum == "e" else p.sum(dim=-1) / PMAX)
            if p_max == "running":  # INT8 codes against the running maximum: no per-step factor
                beta = torch.where(m_new == -math.inf, 0.0, 1.0)
                p = code_p(_exp_running(s_j, m_new))
            f = _div_rn(beta, pmax)[..., None]
        acc = _mm64(p, ops.vc[:, :, j0:j1]) * ops.sv[:, :, j, None, :]
        out = alpha[..., None] * out + (acc if f is None else f * acc)
        m = m_new
    out, visible = _normalise(out, l)
    lse = m + torch.log(l)
    if running:
        lse = lse - math.log(E4M3_MAX)
    lse = torch.where(visible, lse + _lse_shift(q32, ops.kbar, G, scale), -math.inf)
    return out, lse


def _exp_running(s: Tensor, m_new: Tensor) -> Tensor:
    """exp(s - m_new) against the running row maximum; 0 in a row with no visible key yet."""
    return torch.exp(s - torch.where(m_new == -math.inf, 0.0, m_new)[..., None])


def _exp_fp16(s: Tensor, t: Tensor, noise: torch.Generator | None) -> Tensor:
    """exp(s - t) as an FP16 exp2 of an FP16 argument computes it (float32 values); with `noise`,
    the result's relative error drawn uniformly within ex2.approx.f16's bound 2^-9.9."""
    x = ((s - torch.where(t == -math.inf, 0.0, t)[..., None]) * math.log2(math.e)).half()
    e = torch.exp2(x.float()).half().float()
    if noise is not None:
        u = (torch.rand(e.shape, generator=noise, dtype=torch.float64) * 2 - 1) * 2.0 ** -9.9
        e = (e.double() * (1 + u.to(e.device))).clamp(max=1.0).half().float()
    return e


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    grad_lse: Tensor | None = None,
    migrate: float | None = 0.5,
    migrate_pow2: bool | None = None,
    q_block: int = BQ,
    k_block: int = BK,
    dv_product: str = "16bit",
    ds_product: str = "16bit",
) -> tuple[Tensor, Tensor, Tensor]:
    """SPEC_INT8 3: ``(dq, dk, dv)`` in float32 from the forward's ``out`` (as returned, in the
    input dtype) and ``lse`` (as ``attention_forward`` returns it). dK and dV of a KV head sum
    over its query heads. ``grad_lse`` (optional, [B, Hq, Nq]) is the gradient of a loss that also
    uses lse: since d lse_i / d S_ij = P_ij, it enters as Drow_i - grad_lse_i.

    ``migrate`` / ``migrate_pow2`` as in ``attention_forward`` (pass the forward's): S is
    recomputed from the migrated codes; dQ's and dK's 16-bit products see the unmigrated Q and
    K - kbar, and after all key blocks ``dQ = scale dQ + scale * dlse kbar`` (the smoothing
    correction, with the unmigrated kbar; zero without ``grad_lse``) and ``dK = scale dK`` (summed
    over the KV head's query heads). In the ``ds_product="int8"`` study the INT8 products give
    the gradients of Q' and Ks' instead, taken back as ``dQ' * s`` and ``dKs' / s``.

    ``q_block`` / ``k_block`` (study of the scores' scale granularity in training,
    docs/performance.md "Training with the 8-bit attention"; pass the forward's): Q^ and K^ with
    one scale per that many rows / keys, as ``attention_forward`` takes them. Off SPEC_INT8's 64 /
    128 the scales vary inside dQ's and dK's products, so each code is scaled before the product
    (float64, rounded once) rather than the integer product after it.

    ``dv_product``: ``"16bit"`` (the spec, SPEC_INT8 3) is ``dV = P16^T dO16``, P rounded to dP's
    16-bit operand type (FP16 for FP16 inputs, else BF16) times dO in that type, as the forward's
    P.V, the products exact and summed in float64; ``"int8"`` (a study) is the earlier spec's
    ``sPcol sdO P^T dO^``, P^ per key column and dO^ per channel over each 64-row block.

    ``ds_product``: ``"16bit"`` (the spec, SPEC_INT8 3) is ``dQ = scale (dS16 Ks16) + scale
    dlse kbar`` and ``dK = scale (dS16^T Q16)``: dS rounded to dP's 16-bit operand type, Q in that
    type, Ks16 = K - kbar (float32, the unmigrated kbar) rounded to it, the products exact and
    summed in float64, ``scale`` applied once after the sums; these products see the unmigrated
    operands, so no migration factor enters them. ``"int8"`` (a study) is the earlier spec's two
    INT8 dS^ products of the migrated codes (per query row for dQ, per key for dK)."""
    if q_block < 1 or k_block < 1:
        raise ValueError(f"q_block and k_block must be >= 1, got {q_block}, {k_block}")
    if dv_product not in ("int8", "16bit"):
        raise ValueError(f'dv_product must be "int8" or "16bit", got {dv_product!r}')
    if ds_product not in ("int8", "16bit"):
        raise ValueError(f'ds_product must be "int8" or "16bit", got {ds_product!r}')
    mig = _migrate_kw(migrate, migrate_pow2)
    G, scale, allowed, additive = _prepare(q, k, v, attn_mask, is_causal, scale)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    q32, k32, v32 = _as_float32(q), _as_float32(k), _as_float32(v)
    dq = q32.new_zeros(B, Hq, Nq, D)
    dk = q32.new_zeros(B, Hq, Nk, D)  # per query head; summed over the group at the end
    dv = q32.new_zeros(B, Hq, Nk, D)
    if 0 in (B, Hq, Nq, Nk):
        return dq, dk[:, :Hkv], dv[:, :Hkv]
    ops = _Quantized(q32, k32, v32, G, q_block, k_block, **mig)
    spec_q, spec_k = q_block == BQ, k_block == BK
    qs = None if spec_q else ops.qc * ops.sq  # Q^ codes times their row's scale (study)
    do32 = _as_float32(grad_out)
    # Drow and dP on the same 16-bit operands (FP32 inputs rounded to BF16), so that they cancel
    # where they should (one visible key: dS = 0)
    drow = (_dp_operand(grad_out) * _dp_operand(out)).sum(dim=-1, keepdim=True)  # [B, Hq, Nq, 1]
    if grad_lse is not None:
        drow = drow - _as_float32(grad_lse)[..., None]
    lse_s = lse - _lse_shift(q32, ops.kbar, G, scale)  # lse of the smoothed scores
    lse_s = torch.where(lse == -math.inf, math.inf, lse_s)[..., None]  # no visible key: P = 0
    # dP = dO V^T on 16-bit operands: FP16/BF16 inputs as given, FP32 rounded to BF16
    v16, do16 = (_dp_operand(t) for t in (_per_q_head(v, G), grad_out))
    dv_16 = dv_product == "16bit"
    do16_type = torch.float16 if grad_out.dtype == torch.float16 else torch.bfloat16
    if not dv_16:  # dO^ per 64 rows and channel: [B,Hq,nqb,1,D]
        doc, sdo = psi(_blocks(do32, BQ), (3,))
    ds_16 = ds_product == "16bit"
    if ds_16:  # Q16 and Ks16 = K - kbar in dP's 16-bit type, unmigrated
        q16, ks16 = (t.to(do16_type).float() for t in (q32, _per_q_head(k32 - ops.kbar, G)))
    for j in range(-(-Nk // BK)):
        j0, j1 = j * BK, min((j + 1) * BK, Nk)
        p = torch.exp(ops.scores(j, scale, allowed, additive) - lse_s)  # masked -> 0
        if dv_16:  # dV_j += P16^T dO16
            p16 = p.to(do16_type).float()
            dv[:, :, j0:j1] += _mm64(p16.transpose(-1, -2), do16)
        else:  # the study: P^ per key column over each 64-row block, dO^ per channel over the rows
            pc, sp = psi(_blocks(p, BQ), (3,))  # [B, Hq, nqb, 64, keys], sp [B, Hq, nqb, 1, keys]
            acc = _mm64(pc.transpose(-1, -2), doc)  # [B, Hq, nqb, n, D]
            dv[:, :, j0:j1] += ((sp.transpose(-1, -2) * sdo) * acc).sum(dim=2)
        # dS = P * (dP - Drow), dP with FP32 accumulation
        dp = torch.matmul(do16, v16[:, :, j0:j1].transpose(-1, -2))
        ds = p * (dp - drow)
        if ds_16:  # dQ += dS16 Ks16, dK += dS16^T Q16 (scale applied after the sums)
            ds16 = ds.to(do16_type).float()
            dq += _mm64(ds16, ks16[:, :, j0:j1])
            dk[:, :, j0:j1] += _mm64(ds16.transpose(-1, -2), q16)
            continue
        sq = ops.sq[..., 0]  # [B, Hq, Nq]: the 64-row block scale of each row
        # dS^ for dQ: one scale per query row and 64 keys (a row of dQ's product): [B,Hq,Nq,1]
        for h0 in range(j0, j1, BKS):
            h1 = min(h0 + BKS, j1)
            dsc, sds = psi(ds[..., h0 - j0:h1 - j0], (3,))
            if spec_k:
                dq += ((scale * sds) * ops.sk[:, :, j, None, None]) * _mm64(dsc, ops.kc[:, :, h0:h1])
            else:
                ks_ = ops.kc[:, :, h0:h1] * ops.sk_key[:, :, h0:h1, None]
                dq += (scale * sds) * _mm64(dsc, ks_)
        # dS^ for dK: one scale per key over the 64 rows of a query block (a row of dK's product)
        dsc, sds = psi(_blocks(ds, BQ), (3,))  # [B,Hq,nqb,64,keys], sds [B,Hq,nqb,1,keys]
        if spec_q:
            fk = ((scale * sds) * _blocks(sq[..., None], BQ)[..., :1, :]).transpose(-1, -2)
            dk[:, :, j0:j1] += (fk * _mm64(dsc.transpose(-1, -2), _blocks(ops.qc, BQ))).sum(dim=2)
        else:
            fk = (scale * sds).transpose(-1, -2)
            dk[:, :, j0:j1] += (fk * _mm64(dsc.transpose(-1, -2), _blocks(qs, BQ))).sum(dim=2)
    if ds_16:
        dq, dk = dq * scale, dk * scale
    elif mig["migrate"] is not None:  # the gradient of Q' = Q s back to Q
        dq = dq * _per_q_head(ops.mig, G)
    if grad_lse is not None:  # the smoothing correction: d lse / d Q along kbar (SPEC_INT8 3);
        # none where the row sees no key (lse = -inf does not depend on Q)
        dlse = torch.where(lse == -math.inf, 0.0, _as_float32(grad_lse))
        dq += scale * dlse[..., None] * _per_q_head(ops.kbar, G)
    if G > 1:
        dk = dk.reshape(B, Hkv, G, Nk, D).sum(dim=2)
        dv = dv.reshape(B, Hkv, G, Nk, D).sum(dim=2)
    if not ds_16 and mig["migrate"] is not None:  # the gradient of Ks' = Ks / s back to K,
        dk = _div_rn(dk, ops.mig)  # after the group's sum
    return dq, dk, dv
