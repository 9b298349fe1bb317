"""Research probes: one-off measurements behind the write-ups in docs/research/ (not stages of the pipeline, not
performance figures: those are `benchmarks/`). Each runs on a workspace the DAG has built:

    python -m research.binding_oracle     # the sample world's binding headroom (docs/research/binding-headroom.md)
    python -m research.mulclip_terms      # MulCLIP's per-term gradients (docs/research/mulclip-terms.md)
"""
