"""A policy's second pass lives with its policy (`PolicySpec.second_pass`, kvcli.policies.base.SecondPass); the
drivers call its hooks. This module only keeps the old import path of the context reconstruction pass for the code
that still imports it here (kvcli/policies/reconstruction.py)."""
from kvcli.policies.reconstruction import (MIN_REPEAT, REPEAT_MARGIN, Reconstruction, pass_cells, pass_rows, passes,
                                           reconstruct, reconstruct_scores, repeat_room)

__all__ = ["MIN_REPEAT", "REPEAT_MARGIN", "Reconstruction", "pass_cells", "pass_rows", "passes", "reconstruct",
           "reconstruct_scores", "repeat_room"]
