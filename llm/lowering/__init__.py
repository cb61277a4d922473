"""Lowerings: what the blocks of a model definition (:mod:`ptxgen.llm.models`)
become as kernel launches, one per schedule.

- :mod:`.decode`: one token of one sequence (GEMVs, flash decode), the
  graph replayed per token;
- :mod:`.chunk`: the rows of a prompt chunk (GEMMs, chunk attention), a
  graph per chunk size;
- :mod:`.matmul`: the GEMV and GEMM launches both use;
- :mod:`.common`: the persistent buffers they share and the block inputs.
"""
