"""vLLM's serve benchmark client (`vllm.benchmarks.serve`) run with its own flags.

`python -m kvsplice.eval.bench.serve.client --base-url URL --dataset-name random ...` is
`vllm bench serve ...`: the CPU wheel's `vllm` entry points fail on missing package
metadata, so this calls the same `add_cli_args` and `main`. Adds nothing of its own.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM's serve benchmark client")
    add_cli_args(parser)
    serve_main(parser.parse_args(argv))


if __name__ == "__main__":
    main()
