"""The one error every tokenizer module raises."""


class TokenizerError(ValueError):
    """A tokenizer is missing, malformed, unsupported, or was asked to do something impossible."""
