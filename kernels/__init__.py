"""Attention kernels over each KV storage format.

Today every cache family computes attention with pure MLX ops in its own file
(``kvserve.cache.affine.attend_quantized``, ``kvserve.cache.turbo_codec.attend_encoded``);
fused kernels, each tested against such a reference, and their dispatch live here.
"""
