"""Errors meant for a person: the CLI prints them as one line, the server turns them into 4xx."""


class UserError(Exception):
    """Bad input from the user (unknown name, unreadable file, invalid number, prompt too long...)."""


class ModelMismatchError(UserError):
    """A stored cache was made by another model, tokenizer, dtype or format version."""
