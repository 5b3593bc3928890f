"""The captioner: its own process before training (`python -m fluxbooth.captions`), so its memory is free
before FLUX loads. The worker imports only its interface, fluxbooth.contract.captioning."""
