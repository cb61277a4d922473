"""CPU emulator for ptxgen PTX."""
