"""Evaluation: needle in a haystack, RULER-style tasks, fidelity (kvcli eval), and the measuring
helpers kvcli bench shares with it."""
