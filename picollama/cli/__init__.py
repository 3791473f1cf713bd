"""What every command shares: flags, one `error:` line with an exit status, signals, and where
it may write. Nothing here knows about models.

UserError lives here because every layer raises it. run_command (command.py) prints it as one line
and exits with status 2.
"""


class UserError(ValueError):
    """A mistake the user fixes in the command, config, data or paths: one `error:` line, exit 2."""
