"""Triton kernels over the quantized KV-cache layouts: quant_matvec (decode products, inner vs outer groups),
innerq_attention (fused decode attention over an InnerQ cache), quantize_pack (InnerQ's key quantizer)."""
