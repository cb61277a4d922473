"""The model side, above the CUDA layer: GGUF files, the tokenizer and chat
templates, the Llama decode and prefill graphs and their lowering to kernel
launches, the float64 reference decoder, and a synthetic-model writer."""
