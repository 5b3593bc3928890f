"""fluxbooth: a serverless worker that fine-tunes FLUX.1 with DreamBooth under DeepSpeed.

The package root imports nothing heavy: the handler process must never load torch.
"""

__version__ = "0.1.0"
