"""Weight quantization: block-scaled 4-bit formats (MXFP4, NVFP4; int4.py: GGUF's 4-bit integer
blocks kept as a file stores them)."""

from expresslane.quant.formats import FORMATS, MXFP4, NVFP4, Fp4Format, Fp4Tensor, quantize

__all__ = ["FORMATS", "MXFP4", "NVFP4", "Fp4Format", "Fp4Tensor", "quantize"]
