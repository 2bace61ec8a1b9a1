"""Errors that reach users as one clear line (the CLI prints them without a traceback)."""


class SpecfitError(Exception):
    """A problem the user can fix: bad config, bad path, unsupported model, broken plugin."""


class ConfigError(SpecfitError, ValueError):
    """A config key, value or group option is wrong (a ValueError too, for callers that catch those)."""


class PluginError(SpecfitError):
    """A plugin could not be loaded, registered or found, or broke its contract during a run.

    Errors raised while a plug-in runs name it: ``plugin`` (its registered name), ``kind``
    (``selector``, ``drafter``, ...) and ``hook`` (the method that failed or returned a bad value).
    """

    def __init__(self, message: str = "", *, plugin: str | None = None, kind: str | None = None,
                 hook: str | None = None) -> None:
        super().__init__(message)
        self.plugin, self.kind, self.hook = plugin, kind, hook

    def __reduce__(self):  # noqa: ANN204 - keep the fields when pickled (multirun workers)
        return _plugin_error, (str(self), self.plugin, self.kind, self.hook)


def _plugin_error(message: str, plugin: str | None, kind: str | None, hook: str | None) -> PluginError:
    return PluginError(message, plugin=plugin, kind=kind, hook=hook)


class ModelError(SpecfitError):
    """A model or checkpoint cannot be used."""
