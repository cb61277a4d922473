"""GGUF files: the metadata reader, the validated model file and the
synthetic-model writer."""
