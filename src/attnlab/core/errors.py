"""Errors that mean "the input is wrong", not a bug: entry points print the message alone and exit 2.
Raise one where a user's value is wrong, naming its key or file."""


class AttnlabError(Exception):
    """Base class of the errors a user can fix by changing their input."""


class ConfigError(AttnlabError, ValueError):
    """A config value is wrong (names the field and what is expected)."""


class DataError(AttnlabError):
    """A data file is missing, empty, corrupt or does not match its checksum."""


class CheckpointError(AttnlabError):
    """A checkpoint is missing, unreadable or does not fit the model."""


def one_line(e: BaseException) -> str:
    """An exception's message on one line (its type's name where it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


def first_line(e: BaseException) -> str:
    """An exception's type and the first line of its message (200 characters at most)."""
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or ["no details"])[0][:200]
