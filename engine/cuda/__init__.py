"""CUDA, where the engine talks to it directly: a small ctypes binding to the runtime torch has loaded
(``cuda_rt``: IPC handles, peer access, pointer copies and batches of them, event polling), the
caching-allocator block lookup (``cuda_blocks``) and the same-GPU copy kernel (``copy_kernel``,
Triton). Nothing here is imported on a machine without CUDA unless a GPU transport asks for it.
"""
