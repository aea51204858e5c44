"""Errors meant for a person: the CLI prints them as one line, the server turns them into 4xx."""


class UserError(Exception):
    """Bad input from the user (unknown name, unreadable file, invalid number, prompt too long...)."""


class ModelMismatchError(UserError):
    """A stored cache was made by another model, tokenizer, dtype or format version."""


class CorruptSegmentError(UserError):
    """Stored bytes are not a readable kvforge segment (truncated, bad checksum, garbled header)."""


class StoreUnavailableError(UserError):
    """A store backend cannot be reached (e.g. Redis connection refused)."""
