"""The layered parity harness (C0 component ... C4 artifact) and the `fvparity` CLI.

parity/ may import both reference/ and optimized/; it is the only place where the two meet.
"""
