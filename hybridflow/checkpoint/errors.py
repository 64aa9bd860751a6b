"""The one exception type of the checkpoint package."""

RESUME_FIX = "start without resume, or point resume at a complete checkpoint"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written, found or loaded.

    The message names the path, what is wrong with it (the missing file, the mismatched
    value) and what to do about it.
    """


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose files do not match what was recorded when it was saved (truncated,
    missing or altered): a resume may fall back to an older checkpoint (trainer.on_corrupt_checkpoint)."""
