"""Errors that mean "the input is wrong", as opposed to a bug.

Entry points catch these, print the message alone and exit with status 2, so a
user sees one line naming the field or file at fault instead of a traceback.

Which to raise: one of these wherever the value came from a user (a command-line option, a data
or checkpoint file), with the key or file in the message. A constructor (``nn/``, ``models/``)
knows no config keys: a value alone is refused by its annotation (``attnlab.core.specs``), a rule
tying two values by a plain ``ValueError`` starting with the argument's name, which the entry
points name by the node's key (``attnlab.core.config.refusal``). Any other ``ValueError`` is a bug.
"""


class AttnlabError(Exception):
    """Base class of the errors a user can fix by changing their input."""


class ConfigError(AttnlabError, ValueError):
    """A config value is wrong (names the field and what is expected)."""


class DataError(AttnlabError):
    """A data file is missing, empty, corrupt or does not match its checksum."""


class CheckpointError(AttnlabError):
    """A checkpoint is missing, unreadable or does not fit the model."""
