"""Bounds a stage keeps whatever the run's size, owned here because the planner counts them too: the planner times
the scoring and the report from these numbers, and must not import the stages (nor Pillow) to read them."""

from __future__ import annotations

# The most training photos scoring reads, evenly spread over the dataset (sorted by name): enough for a centroid and
# its leave-one-out, and a bound on the scorer's time and memory whatever the dataset's size.
MAX_SCORED_PHOTOS = 48
# Validation rounds a report shows (the samples grid's rows, TensorBoard's images): a long run's are thinned.
MAX_SHOWN_ROUNDS = 10
# Training images the report's dataset contact sheet shows (flagged ones first).
MAX_SHEET_IMAGES = 48
