"""Likeness: does a LoRA's validation render look like the subject, follow its prompt, and not copy a photo?

Scored after training in a process of its own (`python -m fluxbooth.likeness`), never in the worker process and
outside the trainer's memory plan. What the worker and that process agree on is the contract's scoring interface
(fluxbooth.contract.scoring, standard library only); the worker imports nothing of this package.
"""
