"""``specfit serve``: the config's engine behind an OpenAI-compatible HTTP server (specfit.serve).

The engine is built (and its cost model calibrated, where it has one) before the server listens;
a bad ``server.*`` setting or a port in use is one line. The config's ``sampling.*`` and
``max_new_tokens`` are the defaults of every request.
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specfit.api import build
from specfit.errors import ConfigError


def run(cfg: DictConfig, output_dir: Path) -> None:
    from specfit.serve.runner import bind, serve_forever

    if cfg.get("server") is None:
        raise ConfigError("specfit serve needs the server settings (server=default)")
    settings = OmegaConf.to_object(cfg.server)  # checked: port range, limits
    bind(settings.host, settings.port).close()  # a port in use fails now, not after the model is built
    print(f"specfit serve: building the engine ({cfg.model.get('path') or cfg.model.get('builtin')})", file=sys.stderr)
    engine = build(cfg)
    serve_forever(engine, settings, announce=lambda line: print(line, flush=True))
    print("specfit serve: stopped", file=sys.stderr)
