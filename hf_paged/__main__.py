"""``python -m hf_paged demo`` runs the main job; ``python -m hf_paged convert`` only prepares the embedded model;
``python -m hf_paged models`` lists the families (``--markdown``: the table of docs/guide/families.md);
``python -m hf_paged check-kernels`` builds every Triton kernel variant for sm_80/sm_90 (no GPU needed)."""

from __future__ import annotations

import sys

from .demo import main as demo
from .embedded import local_model_dir
from .patches import format_models_table
from .tools.kernel_check import main as check_kernels


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv else "demo"
    if command == "demo":
        return demo(argv)
    if command == "models":
        print(format_models_table(markdown="--markdown" in argv))
        return 0
    if command == "check-kernels":
        return check_kernels(argv)
    if command == "serve":  # needs the 'serve' extra (imported when asked for)
        try:
            from .serve.cli import main as serve
        except ImportError as exc:
            print(f"serving needs the 'serve' extra: pip install 'hf_paged[serve]' (fastapi, uvicorn, "
                  f"prometheus-client); {exc}", file=sys.stderr)
            return 2
        return serve(argv)
    if command == "convert":
        print(local_model_dir())
        return 0
    print("usage: python -m hf_paged [demo|convert|models|check-kernels] [options]  (demo --help for its options)",
          file=sys.stderr)
    print("       python -m hf_paged serve [options]  (serve --help for its options)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
