<<<<<<< HEAD
"""The model side, above the CUDA layer: GGUF files, the Llama decode graph
and its lowering to kernel launches, the float64 reference decoder, and a
synthetic-model writer."""
=======
"""Model-side pieces that sit around the kernels: the tokenizer and chat templates."""
>>>>>>> tokenizer
