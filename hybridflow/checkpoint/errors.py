"""The one exception type of the checkpoint package."""

RESUME_FIX = "start without resume, or point resume at a complete checkpoint"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, found or loaded.

    The message names the path, what is wrong with it (the missing file, the mismatched
    value) and what to do about it.
    """
