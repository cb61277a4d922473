"""The model side, above the CUDA layer: GGUF files, the Llama decode graph
and its lowering to kernel launches, the float64 reference decoder, and a
synthetic-model writer."""
