"""The FLUX DreamBooth trainer. Runs only as a subprocess under `accelerate launch`:

    accelerate launch --config_file JOB/accelerate.yaml -m fluxbooth.train --config JOB/train.json

Importing this package is cheap and torch-free (so the worker may read `fluxbooth.contract.names`);
the modules that train import torch themselves.
"""
