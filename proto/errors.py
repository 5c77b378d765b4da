"""Errors of the shared contract."""


class ContractError(ValueError):
    """A message that breaks the wire contract (malformed batch, bad sizes, bad ids)."""
