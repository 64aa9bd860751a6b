"""The one exception type of the merge package; the CLI prints it as one line and exits 2."""


class MergeError(ValueError):
    """A problem with the inputs, the parameters or the output of a merge.

    The message names the file, the key or the value at fault and what to do about it.
    """
