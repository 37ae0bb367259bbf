"""Generation benchmark: HuggingFace `generate` on a Llama-shaped model (random weights) with the
default cache and torch SDPA against fp4attn's FP4Cache (the low-bit KV cache of SPEC 6: K5 keys,
NVFP4 values, the newest 16 tokens exact; decode through the fused kernel; prefill with
attn_implementation="fp4attn").

For every (batch B, prompt length P): greedy generation of --new tokens after a prompt of P random
tokens, per setup
  default   attn_implementation="sdpa", transformers' DynamicCache (FP16/BF16 keys and values),
            torch's own SDPA backend choice (cuDNN on Hopper, which plans anew for every new
            key length)
  flash     the same with SDPA restricted to the flash backend (the fastest torch decode here)
  fp4cache  attn_implementation="fp4attn", fp4attn.integrations.transformers.FP4Cache
it measures the prefill (a one-token generate), the whole generate (medians of --rounds runs
each), ms per new token ((whole - prefill) / (new - 1)), peak device memory, and the KV cache's bytes per token held
(FP4Cache allocated for P + new tokens at once, as a server sizes it; without max_tokens its
pages double as they fill); from those, the longest context whose cache fits in the memory the
default cache needs at this P.
The model is a 1B-class Llama config (16 layers, 2048 hidden, 32 query / 8 KV heads, head dim 64)
unless --tiny (a 2-layer toy that runs on a CPU in seconds: a smoke test, not a measurement).
Prints a table and writes bench_generate.csv into --out (default: benchmarks/results/).

  python benchmarks/bench_generate.py                          # GPU: B 1 and 8, P 2K and 32K
  python benchmarks/bench_generate.py --tiny --device cpu --batches 1 --prompts 64 --new 4 --out /tmp/x
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_attention import RESULTS, SDPBackend, int_list, sdpa_kernel  # noqa: E402
from provenance import announce, cpu_name, gpu_description, print_table, write_csv  # noqa: E402


def llama_config(tiny: bool):
    import transformers

    if tiny:
        return transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=1 << 17)
    return transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=16, num_attention_heads=32,
                                    num_key_value_heads=8, head_dim=64,
                                    max_position_embeddings=1 << 17)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_generate(model, ids, new, cache_factory, device, backend=None, rounds=3):
    """(seconds of a 1-token generate, seconds of the whole generate, peak bytes, cache object);
    backend: a torch SDPBackend to restrict torch SDPA to."""

    def gen(n):
        kw = {"past_key_values": cache_factory()} if cache_factory else {}
        sync(device)
        t = time.perf_counter()
        with torch.no_grad(), (sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()):
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        sync(device)
        return time.perf_counter() - t, kw.get("past_key_values")

    gen(2)  # warm-up (kernels, allocator)
    # medians of `rounds` runs each: the per-token time is a difference of the two, which single
    # runs made move by tens of percent
    prefill = statistics.median(gen(1)[0] for _ in range(rounds))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    wholes, cache = [], None
    for _ in range(rounds):
        t, cache = gen(new)
        wholes.append(t)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    return prefill, statistics.median(wholes), peak, cache


def kv_bytes_per_token(model, cache, B) -> float:
    """Bytes of keys and values per token position (all layers and the batch) of a cache."""
    cfg = model.config
    if cache is None:  # DynamicCache: 2 tensors x layers x KV heads x head dim x element size
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * model.dtype.itemsize * B
    return sum(layer.cache.nbytes for layer in cache.layers) / len(cache.layers[0].cache)  # held


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (smoke test)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", default="2048,32768")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each generate (medians)")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_generate: no CUDA GPU (use --device cpu with --tiny for a smoke test)")
        return 1
    import transformers

    from fp4attn.integrations import transformers as hf

    hf.register()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(args.tiny)).to(device=device, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    dev = gpu_description() if device.type == "cuda" else cpu_name()
    head = announce(f"{dev}; model: Llama config with {params / 1e9:.2f}B parameters (random weights), {args.dtype}")
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for B in int_list(args.batches):
        for P in int_list(args.prompts):
            ids = torch.randint(0, model.config.vocab_size, (B, P), device=device)
            row = {"B": B, "prompt": P, "new": args.new}
            setups = [("default", "sdpa", None, None),
                      ("fp4cache", "fp4attn",
                       lambda: hf.FP4Cache(config=model.config, max_tokens=P + args.new), None)]
            if device.type == "cuda":
                setups.insert(1, ("flash", "sdpa", None, SDPBackend.FLASH_ATTENTION))
            for name, impl, factory, backend in setups:
                model.config._attn_implementation = impl
                prefill, whole, peak, cache = run_generate(model, ids, args.new, factory, device, backend,
                                                           args.rounds)
                row[f"{name}_prefill_s"] = prefill
                row[f"{name}_ms_per_token"] = 1e3 * (whole - prefill) / max(args.new - 1, 1)
                row[f"{name}_peak_gb"] = peak / 1e9
                row[f"{name}_kv_bytes_per_token"] = kv_bytes_per_token(model, cache, B)
            ratio = row["default_kv_bytes_per_token"] / row["fp4cache_kv_bytes_per_token"]
            row["kv_ratio"] = ratio
            row["fp4cache_context_in_default_kv_memory"] = int((P + args.new) * ratio)
            rows.append(row)
            flash = f" (flash {row['flash_ms_per_token']:.2f})" if "flash_ms_per_token" in row else ""
            print(f"B={B} prompt={P}: default {row['default_ms_per_token']:.2f}{flash} ms/token, peak "
                  f"{row['default_peak_gb']:.2f} GB | FP4Cache {row['fp4cache_ms_per_token']:.2f} ms/token, "
                  f"peak {row['fp4cache_peak_gb']:.2f} GB | KV {ratio:.2f}x smaller: "
                  f"{row['fp4cache_context_in_default_kv_memory']} tokens in the same KV memory", flush=True)
    path = os.path.join(args.out, "bench_generate.csv")
    write_csv(path, head, rows)
    print(f"\nwrote {path}")
    print()
    print_table(["B", "prompt", "default ms/token", "flash ms/token", "FP4Cache ms/token", "default peak GB",
                 "FP4Cache peak GB", "KV ratio", "context in the same KV memory"],
                [[str(r["B"]), str(r["prompt"]), f"{r['default_ms_per_token']:.2f}",
                  f"{r.get('flash_ms_per_token', float('nan')):.2f}",
                  f"{r['fp4cache_ms_per_token']:.2f}", f"{r['default_peak_gb']:.2f}",
                  f"{r['fp4cache_peak_gb']:.2f}", f"{r['kv_ratio']:.2f}",
                  str(r["fp4cache_context_in_default_kv_memory"])] for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())
