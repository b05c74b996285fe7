"""`python -m glance_runtime.serve`: the same as `glance-serve`."""
import sys

from ..cli.serve import main

if __name__ == "__main__":  # importing the package's modules (as the layering test does) must not start a server
    sys.exit(main())
