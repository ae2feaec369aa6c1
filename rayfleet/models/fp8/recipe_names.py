"""The names of the FP8 training recipes, without torch: what a spec validates a precision against.

``recipes.RECIPES`` holds the recipes themselves under these names (``tests/unit/models`` checks
that the two agree); a job's driver and Ray Train's controller read only this module.
"""

from __future__ import annotations

__all__ = ["RECIPE_NAMES"]

RECIPE_NAMES: tuple[str, ...] = ("tensorwise", "delayed", "rowwise", "blockwise")
