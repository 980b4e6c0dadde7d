"""An OpenAI-compatible HTTP server on hf_paged's continuous-batching engine (``pip install 'hf_paged[serve]'``).

    python -m hf_paged serve                      # the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000
    python -m hf_paged serve --model ./my-model --max-memory 4GiB --api-key "$KEY"

In code::

    from hf_paged.serve import ServeSettings, create_app
    app = create_app(manager, tokenizer, ServeSettings(model_name="my-model"))   # any ASGI server runs it

Files: ``app`` (routes), ``protocol`` (request fields and their checks), ``responses`` (OpenAI shapes),
``engine_client`` (engine thread <-> event loop), ``detokenizer`` (whole characters only), ``stops`` (stop strings
with hold-back), ``metrics`` (Prometheus), ``middleware`` (API key, body limit, request id, log line), ``errors``,
``cli``. Replicas on Ray Serve (the ``replicas`` extra, ``serve --replicas N``): ``replicas`` (the deployments),
``prefix_router`` (routing by prompt prefix), ``asgi`` (the app called in-process), ``ray_app`` (``serve run``).
"""

from .app import ServeSettings, create_app

__all__ = ["ServeSettings", "create_app"]
