"""Text at the boundaries: what comes in from HTTP, stdin, files and argv, made sure to be UTF-8.

Bytes that are not UTF-8, and strings holding lone surrogates, are refused with one UserError
that names where they came from. Nothing is replaced with U+FFFD on the way in."""

from picollama.cli import UserError

# Python decodes a byte that is not UTF-8 (argv, stdin) to one of these surrogates.
ESCAPED_BYTES = range(0xDC80, 0xDD00)


def checked_text(value: str, where: str, hint: str = "") -> str:
    """value, refused unless it encodes as UTF-8, that is holds no lone surrogate.

    Python gives lone surrogates for argv or stdin bytes it could not decode, and a JSON decoder
    gives them for escapes like "\\ud800". UserError names `where` and the byte offset. `hint`
    is added to the message, say what to do about it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = len(value[: e.start].encode("utf-8"))
        code = ord(value[e.start])
        what = f"byte {byte}"
        if code not in ESCAPED_BYTES:
            what = f"lone surrogate U+{code:04X} at {what}"
        raise UserError(f"{where} is not UTF-8 text ({what}){hint}") from None
    return value


def checked_bytes(raw: bytes, where: str, hint: str = "") -> str:
    """raw decoded as UTF-8. UserError names `where` and the first bad byte's offset."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{where} is not UTF-8 text (byte 0x{raw[e.start]:02x} at {e.start}){hint}"
        ) from None


class TextError(UserError):
    """Text not UTF-8 in a JSON value. `path` names the field, as in messages[0].content."""

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path


def check_strings(value, where: str = ""):
    """TextError naming the first field of a decoded JSON value whose name or text is not UTF-8.

    A JSON escape like "\\ud800" decodes to a lone surrogate, which no tokenizer can take.
    `where`, if given, comes first in the message, say a file and line."""
    stack = [(value, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, list):
            stack += [(item, f"{path}[{i}]") for i, item in reversed(list(enumerate(value)))]
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                name = f"{path}.{key}".lstrip(".")
                shown = name.encode("utf-8", "backslashreplace").decode("utf-8")
                check_string(key, f"the field name '{shown}'", shown, where)
                items.append((item, name))
            stack += reversed(items)
        elif isinstance(value, str):
            check_string(value, f"'{path}'", path, where)


def check_string(value: str, field: str, path: str, where: str):
    """TextError naming `field` (after `where`) unless value is UTF-8 text."""
    try:
        checked_text(value, field)
    except UserError as e:
        raise TextError(f"{where}: {e}" if where else str(e), path) from None
