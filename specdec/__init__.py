"""Speculative decoding engine: pure PyTorch + numpy, no Triton import."""
__version__ = "0.1.0"
