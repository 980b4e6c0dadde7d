"""The Ray Serve entry point for Ray's own tools: ``serve run`` / ``serve deploy`` with a config file, or Python.

``app_builder(args)`` takes the flags of ``python -m hf_paged serve`` as a dict (``replicas: 2`` for ``--replicas 2``,
``no_prefix_caching: true`` for a switch) and returns the application of ``hf_paged/serve/replicas.py``::

    serve run hf_paged.serve.ray_app:app_builder model=/models/my-model replicas=2 replica_gpus=1

or, in a config file (``serve run config.yaml``; Ray's ``deployments:`` section can override ``num_replicas``,
``ray_actor_options`` or ``autoscaling_config`` of ``EngineReplica`` and ``Ingress``)::

    applications:
    - name: hf_paged
      route_prefix: /
      import_path: hf_paged.serve.ray_app:app_builder
      args: {model: /models/my-model, replicas: 2, replica_gpus: 1, max_memory: 20GiB}
"""

from __future__ import annotations

from ray import serve

from .cli import build, parser
from .replicas import application


def flags(args: dict) -> list[str]:
    """The serve CLI's argv for a dict of its flags: ``{"replicas": 2, "no_prefix_caching": True}`` ->
    ``["--replicas", "2", "--no-prefix-caching"]`` (``"true"`` / ``"false"`` strings, as ``serve run key=value``
    sends them, are switches; a list repeats its flag)."""
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, str) and value.lower() in ("true", "false"):  # `serve run ... key=true` sends strings
            value = value.lower() == "true"
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, str(value)]
    return argv


def app_builder(args: dict) -> serve.Application:
    """The application for ``args`` (the serve CLI's flags as a dict; ``replicas`` defaults to 1)."""
    parsed = parser().parse_args(flags({"replicas": 1, **args}))
    return application(parsed, build)
