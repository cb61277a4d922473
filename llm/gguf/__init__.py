"""GGUF files: the reader of untrusted files (metadata, tensor infos, data as
views of one map), the validated model file and the synthetic-model writer."""
