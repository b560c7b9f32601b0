"""`python -m kvsplice.eval.bench.shared`: the shared-tier bench (`bench.main`)."""

from kvsplice.eval.bench.shared.bench import main

if __name__ == "__main__":  # not again in the load's spawned processes (they import this)
    main()
