"""Errors that reach users as one clear line (the CLI prints them without a traceback)."""


class SpecfitError(Exception):
    """A problem the user can fix: bad config, bad path, unsupported model, broken plugin."""


class ConfigError(SpecfitError, ValueError):
    """A config key, value or group option is wrong (a ValueError too, for callers that catch those)."""


class PluginError(SpecfitError):
    """A plugin could not be loaded, registered or found."""


class ModelError(SpecfitError):
    """A model or checkpoint cannot be used."""
