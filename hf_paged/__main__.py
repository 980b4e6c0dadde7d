"""``python -m hf_paged demo`` runs the main job; ``python -m hf_paged convert`` only prepares the embedded model;
``python -m hf_paged models`` lists the families (``--markdown``: the table of docs/guide/families.md);
``python -m hf_paged check-kernels`` builds every Triton kernel variant for sm_80/sm_90 (no GPU needed)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "demo"
    if command == "demo":
        from .demo import main as demo

        return demo(argv)
    if command == "models":
        from .patches import format_models_table

        print(format_models_table(markdown="--markdown" in argv))
        return 0
    if command == "check-kernels":
        from .tools.kernel_check import main as check_kernels

        return check_kernels(argv)
    if command == "serve":
        from .serve.cli import main as serve

        return serve(argv)
    if command == "convert":
        from .embedded import local_model_dir

        print(local_model_dir())
        return 0
    print("usage: python -m hf_paged [demo|convert|models|check-kernels] [options]  (demo --help for its options)",
          file=sys.stderr)
    print("       python -m hf_paged serve [options]  (serve --help for its options)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
