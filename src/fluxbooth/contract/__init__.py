"""What the worker and its child processes (the trainer, the likeness scorer) must agree on, in one room.

The trainer config, the typed events, DeepSpeed's numbers, the names and file layout both processes use, the
Kontext pairing, bucket and caption rules and the base-precision names; and what the worker and the likeness
scoring process agree on (`scoring`). Torch-free, and importing nothing of fluxbooth outside this package, so
either side can read it without loading the other.
"""
