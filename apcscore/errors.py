"""The one domain exception: a problem the user can fix, shown as a clear error by the CLI."""


class ApcscoreError(Exception):
    """A user-facing error: bad input, bad option, unsupported model. The CLI prints it and exits.

    `exit_code` is 2 for input and usage errors (nothing was run), 1 otherwise.
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
