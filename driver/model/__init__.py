"""Model-side pieces that sit around the kernels: the tokenizer and chat templates."""
