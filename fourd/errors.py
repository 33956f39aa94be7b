"""The one exception a user can meet. The CLI prints its message on one line and exits 2."""


class FourdError(Exception):
    """Bad input (config, layout, data, checkpoint, request): the message names the bad value and the fix."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
