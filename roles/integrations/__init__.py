"""Integrations with what users already run: vLLM workers, torchrun, Ray, and non-async loops.

| module | what |
| --- | --- |
| ``threads`` | ``BackgroundLoop`` (weightsync beside synchronous code) and ``GenerationGate`` (no forward pass during an in-place round) |
| ``vllm_worker`` | ``WeightSyncWorkerExtension``: a vLLM worker as a receiver of its own parameters (``EXTENSION``) |
| ``torchrun`` | senders that find their rank, device and controller through torch.distributed |
| ``ray_actors`` | the controller, senders and receivers as Ray actors |

Each is imported on its own: importing this package imports neither vLLM, torch.distributed nor Ray.
"""
