"""specparity: the correctness and regression gate for speculative decoders."""

__version__ = "0.1.0"
