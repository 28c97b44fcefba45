"""Weight quantization: block-scaled 4-bit formats (MXFP4, NVFP4)."""

from expresslane.quant.formats import FORMATS, MXFP4, NVFP4, Fp4Format, Fp4Tensor, quantize

__all__ = ["FORMATS", "MXFP4", "NVFP4", "Fp4Format", "Fp4Tensor", "quantize"]
