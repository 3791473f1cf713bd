"""Small text files the user names, such as a config, a recipe or a chat template. Only regular
files, up to a size limit."""

import os
import stat

from picollama.cli import UserError
from picollama.cli.outputs import file_kind

SMALL_TEXT_BYTES = 1_000_000  # A config, a recipe or a chat template is a few KB.


def regular_file_size(path, flag: str) -> int:
    """The size of the file named at `flag`. UserError unless it is a regular file.

    Nothing else is opened. A device such as /dev/zero reads for ever, and a FIFO blocks."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise UserError(f"{flag} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else file_kind(path) or "not a file"
        raise UserError(f"{flag} {path} is {kind}, not a regular file")
    return info.st_size


def read_small_text(path, flag: str, limit: int = SMALL_TEXT_BYTES) -> str:
    """The UTF-8 text of the small file named at `flag`.

    UserError names the flag and path for anything but a regular file, or text that is not UTF-8.
    So does a file over `limit` bytes. It is read no further, since it may be growing."""
    size = regular_file_size(path, flag)
    data = b""
    if size <= limit:  # A file already too large is never read.
        try:
            with open(path, "rb") as file:
                data = file.read(limit + 1)
        except OSError as e:
            raise UserError(f"{flag} {path}: {e.strerror or e}") from None
    held = max(size, len(data))
    if held > limit:
        raise UserError(f"{flag} {path} holds {held:,} bytes: at most {limit:,} are read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path} is not UTF-8 text (byte {e.start}); re-save it") from None
