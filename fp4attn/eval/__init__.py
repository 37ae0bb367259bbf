"""Accuracy study of fp4attn on real models and real text, offline.

    fp4attn.eval.models   the offline models (SmolLM2-135M, Gemma 3 270M, all-MiniLM-L6-v2) and
                          the Austen corpus;
                          `python -m fp4attn.eval.models {fetch-corpus,status,prepare}`
    fp4attn.eval.report   `python -m fp4attn report`: per-layer error against exact attention,
                          ablations, perplexity and embedding similarity
    fp4attn.eval.int8_granularity
                          `python -m fp4attn.eval.int8_granularity`: the 8-bit attention with
                          finer Q / K scale granularities (docs/accuracy.md)

Not imported by `import fp4attn`: import the submodules where they are needed.
"""
