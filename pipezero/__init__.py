"""pipezero: pipeline parallelism + ZeRO training of decoder-only language models on torch.distributed."""

__version__ = "0.1.0"
