"""``specfit serve``: an OpenAI-compatible HTTP server for one offloaded MoE engine.

- :mod:`specfit.serve.protocol`: request parsing and validation, OpenAI-shaped errors and responses;
- :mod:`specfit.serve.chat`: chat messages to a prompt (the tokenizer's template, or a plain one);
- :mod:`specfit.serve.worker`: the bounded FIFO queue and the one thread that decodes (batch size 1);
- :mod:`specfit.serve.metrics`: the Prometheus registry (vLLM's names under ``specfit:``);
- :mod:`specfit.serve.app`: the FastAPI app and its routes; :mod:`specfit.serve.runner`: uvicorn.

Nothing in a request names a file or a plug-in: the engine is built from the server's config alone.
"""
