"""cuda-python driver layer (installed as ptxgen.driver)."""
