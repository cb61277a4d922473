"""The model side, above the CUDA layer: GGUF files, the tokenizer and chat
templates, the Llama decode graph and its lowering to kernel launches, text
generation, the float64 reference decoder, and a synthetic-model writer."""
