"""Triton (and, on an H100, Gluon) kernels, each module with its torch reference: the decode attention of each
quantized layout (quant_matvec, innerq_attention, innerq_hopper, outer_attention, outer_hopper,
alignedkv_attention, xquant_remat, scores), quantizing and packing (quantize_pack), 4-bit weights (w4a16,
w4a16_hopper), and the model's own small operations on a GPU (layer_ops)."""
