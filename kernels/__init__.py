"""Triton kernels and their thin launch wrappers (imported as longctx.kernels).

Launch wrappers take already validated tensors; the public API in longctx does the checks.
"""
