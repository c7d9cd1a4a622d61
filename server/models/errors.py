"""The one error model loading raises for what a user can fix."""


class ModelLoadError(Exception):
    """A model cannot be found, read or converted. The message is one line meant for
    the person who chose the model."""
